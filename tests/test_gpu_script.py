"""The GPU bench's one command (bench/gpu/run.sh) runs every step on CPU: `--dry-run`, as CI runs it.

The first DeepSpeed start on a machine JIT-builds a CPU comm op (1-4 min on 2 cores), cached in
TORCH_EXTENSIONS_DIR (`make test` points it into .venv); later runs take ~2 min.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_gpu_bench_dry_run_writes_every_run_and_the_loss_check(tmp_path):
    env = os.environ | {"OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu/run.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "loss check" in proc.stdout  # the table was printed

    result = json.loads((tmp_path / "out" / "ppo_bench.json").read_text())
    runs = {r["run"]: r for r in result["runs"]}
    assert set(runs) == {"deepspeed/full", "plain/full", "deepspeed/lora", "plain/lora"}
    for name, r in runs.items():
        assert r["tokens_per_s"] > 0, name
        assert all(math.isfinite(n) and n > 0 for n in r["grad_norms"]), (name, r["grad_norms"])
        assert r["micro_batch"] * r["grad_accum"] == result["bench"]["step_rows"], name
    # full trains every weight; LoRA exactly the adapters' (the parameters it adds to the same model)
    full, lora = runs["deepspeed/full"], runs["deepspeed/lora"]
    assert full["trainable_params"] == full["params"]
    assert lora["trainable_params"] == lora["params"] - full["params"] > 0
    # the same weights, data and loss: DeepSpeed (bf16) and the plain loop (autocast bf16) take the same first step
    for weights in ("full", "lora"):
        ds, plain = runs[f"deepspeed/{weights}"]["grad_norms"][0], runs[f"plain/{weights}"]["grad_norms"][0]
        assert ds == pytest.approx(plain, rel=0.05), weights

    check = result["loss_check"]
    assert math.isfinite(check["loss_fp32"]) and math.isfinite(check["loss_bf16"])
    assert check["loss_fp32"] != 0.0 and check["rel_diff"] < 0.05  # bf16 is close to fp32, and not the same number
    assert 0.0 < check["logp_abs_diff_max"] < 1.0
