"""`tabrl doctor` says what this machine is (issue 54): its CPU, the instruction set PyTorch's kernels use, bf16
units, the dtypes this config resolves to, and the vLLM that serving.vllm_python imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from typer.testing import CliRunner

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


def _probe(decided: int, train_s: float, evaluate_s: float, status: str):
    from flows.demo_plan import Probe
    from flows.loop_state import CycleRow

    row = CycleRow(1, "champion:1", decided, 0.3, 0.1, 0.1, 0.01, -0.05, "-", status, None, None, None, None, None, {})
    row = replace(row, traffic_s=20.0, train_s=train_s, evaluate_s=evaluate_s, typing_s=evaluate_s / 2, cycle_s=40.0)
    return Probe(row, requests=40, gate_requests=40, startup_s=30.0)


def test_doctor_predicts_a_cycle_from_the_timed_one_and_refuses_when_it_trained_nothing(monkeypatch):
    """The timed cycle itself is tested for real (tests/test_demo.py); here, what the doctor says from one."""
    import flows.demo_plan
    from flows.cli.main import app
    from flows.demo_plan import cycle_wall_s, scaled
    from tasks.core.config import load_params

    monkeypatch.setattr(flows.demo_plan, "probe_cycle", lambda *args: _probe(30, 5.0, 12.0, "deployed"))
    done = CliRunner().invoke(app, ["doctor", "--json", "--no-vllm", "--predict", "cycle", "--requests", "400"])
    assert done.exit_code == 0, done.output
    prediction = json.loads(done.output)["prediction"]
    row = scaled(_probe(30, 5.0, 12.0, "deployed"), 400, load_params().evaluate.n_requests)
    assert prediction["predicted_s"] == pytest.approx(cycle_wall_s(row, load_params()))
    assert prediction["traffic_s"] == pytest.approx(200.0) and prediction["train_s"] == pytest.approx(50.0)

    monkeypatch.setattr(flows.demo_plan, "probe_cycle", lambda *args: _probe(0, 0.0, 0.0, "skipped"))
    done = CliRunner().invoke(app, ["doctor", "--no-vllm", "--predict", "cycle"])
    assert done.exit_code == 1
    assert "No prediction" in done.output and "0 of 40 requests decided" in done.output


def test_doctor_predict_before_make_data_exits_2_with_a_sentence(tmp_path):
    """A fresh clone has no typing regions until `make data`: --predict says so instead of a traceback."""
    done = doctor("--no-vllm", "--predict", "demo", "--set", f"paths.data_dir={tmp_path}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"{tmp_path}/fim/typing_train.parquet" in done.stderr and "make data" in done.stderr
