"""`tabrl doctor` says what this machine is (issue 54): its CPU, the instruction set PyTorch's kernels use, bf16
units, the dtypes this config resolves to, and the vLLM that serving.vllm_python imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tasks.core.dtypes import cpu_bf16_units


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flows.cli", "doctor", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=os.environ | (env or {}))


def test_doctor_names_the_cpu_its_kernels_bf16_units_and_the_dtypes_host_resolves_to():
    done = doctor("--json", "--no-vllm", "--set", "train.compute_dtype=host")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["cores"] >= 1 and record["cpu"]
    assert record["isa"] in ("AVX512", "AVX2", "DEFAULT", "ZVECTOR", "VSX", "SVE256", "SVE128")
    assert record["bf16_units"] == cpu_bf16_units()
    assert record["host_dtype"] == ("bfloat16" if record["bf16_units"] else "float32")
    assert record["train_dtype"] == record["host_dtype"] and record["vllm_dtype"] is None
    assert "vllm" not in record


def test_doctor_reports_an_emulated_avx2_machine_as_avx2():
    """The slow machine's emulation (ATEN_CPU_CAPABILITY=avx2) reads as what PyTorch then runs."""
    first = json.loads(doctor("--json", "--no-vllm").stdout)
    if "avx2" not in first["cpu_flags"]:
        pytest.skip("this CPU has no AVX2")
    emulated = json.loads(doctor("--json", "--no-vllm", env={"ATEN_CPU_CAPABILITY": "avx2"}).stdout)
    assert emulated["isa"] == "AVX2" and emulated["cpu_flags"] == first["cpu_flags"]


def test_doctor_says_where_no_vllm_can_be_imported_and_how_to_build_one(tmp_path):
    done = doctor("--set", f"serving.vllm_python={tmp_path / 'no-such-python'}")
    assert done.returncode == 0, done.stderr
    assert "no vLLM" in done.stdout and "no-such-python" in done.stdout
    assert "bash .ci/vllm-venv.sh" in done.stdout


def test_doctor_gives_the_version_of_the_vllm_it_finds(vllm_python):
    record = json.loads(doctor("--json", "--set", f"serving.vllm_python={vllm_python}").stdout)
    version = subprocess.run(
        [vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    ).stdout.strip()
    assert record["vllm"]["version"] == version and version
