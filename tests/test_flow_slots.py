"""One cycle at a time and one change of the arms at a time (flows/slots.py), on a real `prefect server` with the
deployments served by `tabrl schedule`: two runs of online-rl-cycle started together train once, and an A/B
decision waits while another run holds the arms."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime

import httpx
import yaml
from mlflow import MlflowClient

from tasks.core import vocab
from tests.conftest import tiny_params
from tests.support.prefect_server import prefect_cli
from tests.test_flow_cycle import (
    EVERY_ANSWER_TAKEN,
    FAST_TRAIN,
    _dvc_repo,
    champion_serving_traffic,
    write_cycle_inputs,
)


def _runner(repo, params_file, env, log_path):
    """`tabrl schedule` serving both deployments from the project repo (its snapshots repo: write_cycle_inputs')."""
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "schedule", "--params", str(params_file)],
        cwd=repo,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


def _wait_deployments(api: str, proc, log_path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()[-2000:]
        names = {d["name"] for d in httpx.post(f"{api}/deployments/filter", json={}).json()}
        if {"online-rl-cycle", "ab-decision"} <= names:
            return
        time.sleep(1)
    raise AssertionError("the deployments were not served within 120 s")


def _start(name: str, env) -> str:
    started = prefect_cli("deployment", "run", name, env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    printed = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout)  # the flow run's, as test_flow_schedule reads it
    assert printed, f"no flow-run UUID in `prefect deployment run`'s output: {started.stdout}"
    return printed.group(1)


def _finished(api: str, run_ids: list[str], log_path, timeout_s: float = 300) -> dict[str, dict]:
    deadline, runs = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        runs = {rid: httpx.get(f"{api}/flow_runs/{rid}").json() for rid in run_ids}
        if all(r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs.values()):
            return runs
        time.sleep(1)
    raise AssertionError(
        f"runs not finished: {[r['state']['type'] for r in runs.values()]}\n{log_path.read_text()[-3000:]}"
    )


def _stop(proc, log) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # the runner before the server, or it hangs (STACK-NOTES)
    proc.wait(30)
    log.close()


def test_two_cycles_started_together_train_once(
    tmp_path, prefect_server, tiny_model_dir, fim_samples, typing_regions, mlflow_store
):
    env = prefect_server
    repo = _dvc_repo(tmp_path / "repo")
    sections = {
        "simulator": EVERY_ANSWER_TAKEN,
        "serving": {"auth": False, "temperature": 1.0, "max_tokens": 1},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": FAST_TRAIN,
        "evaluate": {"n_samples": 16, "n_requests": 32, "max_new_tokens": 1, "gate_tolerance": 1.0},
        "deploy": {"cycle_every_minutes": 600, "decision_every_minutes": 600},
    }
    params, params_file = write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, **sections)
    champion_serving_traffic(tiny_model_dir, params, typing_regions, 4, 48)
    time.sleep(params.ingest.feedback_timeout_s + 0.2)
    proc, log = _runner(repo, params_file, env, tmp_path / "runner.log")
    try:
        api = env["PREFECT_API_URL"]
        _wait_deployments(api, proc, tmp_path / "runner.log")
        ids = [_start("online-rl-cycle/online-rl-cycle", env) for _ in range(2)]
        runs = _finished(api, ids, tmp_path / "runner.log")
    finally:
        _stop(proc, log)
    assert [r["state"]["type"] for r in runs.values()] == ["COMPLETED"] * 2, (tmp_path / "runner.log").read_text()[
        -3000:
    ]
    client = MlflowClient(params.paths.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name(params.deploy.experiment)
    cycles = client.search_runs(
        [experiment.experiment_id], f"tags.`{vocab.KIND}` = 'cycle'", order_by=["attributes.start_time ASC"]
    )
    outcomes = [(r.data.tags[vocab.CYCLE_STATUS], r.data.tags[vocab.CYCLE_REASON]) for r in cycles]
    assert len(cycles) == 2 and outcomes[1] == ("skipped", "another cycle is running"), outcomes
    trained, skipped = cycles
    assert outcomes[0][0] in ("deployed", "gate_failed") and "train/loss" in trained.data.metrics, outcomes
    # they overlapped: the second was refused while the first held the slot, not after it had finished
    assert trained.info.start_time <= skipped.info.start_time <= trained.info.end_time
    snapshots = sorted(p.name for p in (repo / params.paths.data_dir).rglob("*.parquet.dvc"))
    assert len(snapshots) == 1, f"one snapshot ingested, not two: {snapshots}"


def test_an_ab_decision_waits_while_another_run_holds_the_arms(tmp_path, prefect_server):
    env = prefect_server
    params = tiny_params(tmp_path, deploy={"cycle_every_minutes": 600, "decision_every_minutes": 600})
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    hold = f"import json, time\nfrom flows.slots import arms_slot\nwith arms_slot({params.paths.database_url!r}):\n"
    hold += "    print(json.dumps({'held': time.time()}), flush=True)\n    time.sleep(30)\n"
    hold += "print(json.dumps({'released': time.time()}), flush=True)\n"
    proc, log = _runner(tmp_path, params_file, env, tmp_path / "runner.log")
    try:
        api = env["PREFECT_API_URL"]
        _wait_deployments(api, proc, tmp_path / "runner.log")
        holder = subprocess.Popen([sys.executable, "-c", hold], env=env, stdout=subprocess.PIPE, text=True)
        held = json.loads(holder.stdout.readline())["held"]
        run_id = _start("ab-decision/ab-decision", env)
        released = json.loads(holder.stdout.readline())["released"]
        holder.wait(30)
        run = _finished(api, [run_id], tmp_path / "runner.log")[run_id]
    finally:
        _stop(proc, log)
    assert run["state"]["type"] == "COMPLETED", (tmp_path / "runner.log").read_text()[-3000:]
    ended = datetime.fromisoformat(run["end_time"]).timestamp()
    started = datetime.fromisoformat(run["start_time"]).timestamp()
    assert held < started < released, "the decision ran while the arms were held (else nothing was tested)"
    assert released <= ended, "the decision finished while another run held the arms"
