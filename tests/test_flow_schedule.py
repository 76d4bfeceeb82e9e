"""`tabrl schedule` against a real `prefect server`: both deployments with their schedules, and a
manual run (`prefect deployment run`) executed by the served runner."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import yaml

from tests.conftest import tiny_params
from tests.support.prefect_server import prefect_cli


def test_schedule_serves_both_flows_and_runs_a_manual_run(tmp_path, prefect_server):
    env = prefect_server
    params = tiny_params(tmp_path, deploy={"cycle_every_minutes": 90, "decision_every_minutes": 7})
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    log = open(tmp_path / "runner.log", "w")
    runner = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "schedule", "--params", str(params_file)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        api = env["PREFECT_API_URL"]
        deadline, found = time.monotonic() + 120, {}
        while time.monotonic() < deadline and len(found) < 2:
            assert runner.poll() is None, (tmp_path / "runner.log").read_text()[-2000:]
            found = {d["name"]: d for d in httpx.post(f"{api}/deployments/filter", json={}).json()}
            time.sleep(1)
        assert set(found) == {"online-rl-cycle", "ab-decision"}
        intervals = {name: d["schedules"][0]["schedule"]["interval"] for name, d in found.items()}
        assert intervals == {"online-rl-cycle": 90 * 60, "ab-decision": 7 * 60}

        started = prefect_cli("deployment", "run", "ab-decision/ab-decision", env=env)
        assert started.returncode == 0, started.stdout + started.stderr
        # the manual run by its id: the served schedules add SCHEDULED runs of their own beside it
        printed = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout)
        assert printed, f"no flow-run UUID in `prefect deployment run`'s output: {started.stdout}"
        run_id = printed.group(1)
        deadline, state = time.monotonic() + 180, None
        while time.monotonic() < deadline and state not in ("COMPLETED", "FAILED", "CRASHED"):
            state = httpx.get(f"{api}/flow_runs/{run_id}").json()["state"]["type"]
            time.sleep(1)
        assert state == "COMPLETED", (tmp_path / "runner.log").read_text()[-3000:]
    finally:
        os.killpg(runner.pid, signal.SIGTERM)  # the runner before the server, or it hangs (STACK-NOTES)
        runner.wait(30)
        log.close()
