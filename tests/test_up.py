"""`tabrl up` (flows/stack.py): the always-on stack in one command, brought up for real and stopped by Ctrl-C.

A real Prefect server, MLflow server, two Prefect process workers and the gateway, under supervisord, in a
temporary directory on free ports. Checked: every process answers, the deployments are registered with
their schedules, a new store gets the champion as its one arm, each process logs to its own file under the
state dir, a second `tabrl up` on the same state dir is refused, a gateway killed with SIGKILL is started
again, and after SIGINT nothing that ran below `tabrl up` is left alive and no port is still taken.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import yaml

from tasks.core.procs import free_port
from tasks.core.store import CHAMPION, open_store, read_arms

UP_TIMEOUT_S = 300


def _write_params(tmp_path, model_dir, gateway_port):
    params = {
        "model": {"base_dir": str(model_dir)},
        "paths": {
            "state_dir": str(tmp_path / "state"),
            "database_url": f"sqlite:///{tmp_path / 'state' / 'tabrl.db'}",
            "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'state' / 'mlflow.db'}",
        },
        "serving": {"port": gateway_port},
        # No scheduled run fires during the test: it checks the schedules are there, not what they run.
        "deploy": {"cycle_every_minutes": 600, "decision_every_minutes": 600},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _wait_for_line(proc, text, timeout_s):
    """Read proc's stdout until a line contains text; every line read so far."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return seen
    pytest.fail(f"no {text!r} from tabrl up within {timeout_s} s (exit {proc.poll()}):\n{''.join(seen)}")


def _listening(port):
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _gateway_pid(root):
    for child in psutil.Process(root).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue  # gone, or a zombie not yet reaped
        if "flows.cli" in cmd and "serve" in cmd:
            return child.pid
    return None


def _answers(url):
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_tabrl_up_brings_the_stack_up_and_ctrl_c_leaves_nothing_running(tmp_path, tiny_model_dir):
    prefect_port, mlflow_port, gateway_port = free_port(), free_port(), free_port()
    params_file = _write_params(tmp_path, tiny_model_dir, gateway_port)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "TABRL_"))}
    cmd = [sys.executable, "-m", "flows.cli", "up", "--no-auth", "--params", str(params_file)]
    cmd += ["--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        said = "".join(_wait_for_line(proc, "Ctrl-C stops everything", UP_TIMEOUT_S))
        gateway = f"http://127.0.0.1:{gateway_port}"
        assert httpx.get(f"{gateway}/v1/models").json()["data"][0]["id"] == "tabrl-completion/1"  # the champion arm
        api = f"http://127.0.0.1:{prefect_port}/api"
        deployments = httpx.post(f"{api}/deployments/filter", json={}).json()
        by_name = {d["name"]: d for d in deployments}
        assert set(by_name) == {"online-rl-cycle", "ab-decision", "train-candidate"}
        for name in ("online-rl-cycle", "ab-decision"):
            (schedule,) = by_name[name]["schedules"]
            assert schedule["schedule"]["interval"] == 600 * 60, schedule
            # their flow runs run in the repo, where params' relative paths (data/fim) are
            assert by_name[name]["job_variables"]["working_dir"] == str(tmp_path), by_name[name]["job_variables"]
        assert httpx.get(f"http://127.0.0.1:{mlflow_port}/health").status_code == 200
        # A new store gets the champion (the base, version 1) as its one arm, as the champion alias names it.
        with open_store(f"sqlite:///{tmp_path / 'state' / 'tabrl.db'}") as store:
            (arm,) = read_arms(store)
        assert (arm.name, arm.model_version) == (CHAMPION, "tabrl-completion/1")
        assert "the champion tabrl-completion/1 is the one arm" in said
        # `up` waited for each worker to be online in its pool (its first heartbeat) ...
        api_workers = {
            pool: httpx.post(f"{api}/work_pools/{pool}/workers/filter", json={}).json() for pool in ("cpu", "gpu")
        }
        assert all(any(w["status"] == "ONLINE" for w in ws) for ws in api_workers.values()), api_workers
        # ... and each process logs to its own file (a worker prints "started!" just after its first heartbeat)
        logs = tmp_path / "state" / "up" / "logs"
        deadline = time.monotonic() + 30
        while "started" not in (logs / "worker-gpu.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "started" in (logs / "worker-gpu.log").read_text()
        for name in ("prefect", "mlflow", "worker-cpu", "worker-gpu", "gateway", "deploy"):
            assert (logs / f"{name}.log").stat().st_size > 0, name
        second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "already runs on this state dir" in second.stderr, second.stderr

        # A gateway that dies is started again by supervisord.
        first = _gateway_pid(proc.pid)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            again = _gateway_pid(proc.pid)
            if again not in (None, first) and _answers(f"{gateway}/healthz"):
                break
            time.sleep(0.5)
        else:
            pytest.fail("the killed gateway was not started again within 120 s")

        below = psutil.Process(proc.pid).children(recursive=True)
        assert len(below) >= 6  # supervisord and its five programs, at least
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        assert "stopped every process of this stack" in out
        _, alive = psutil.wait_procs(below, timeout=5)
        assert not alive, [p.cmdline() for p in alive]
        assert not any(_listening(p) for p in (prefect_port, mlflow_port, gateway_port))
    finally:
        if proc.poll() is None:  # a failed check: supervisord runs in a session of its own, so kill all below too
            below = psutil.Process(proc.pid).children(recursive=True)
            os.killpg(proc.pid, signal.SIGKILL)
            for child in below:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            proc.wait()


def test_tabrl_up_refuses_replicas_on_sqlite(tmp_path, tiny_model_dir):
    params_file = _write_params(tmp_path, tiny_model_dir, free_port())
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "up", "--gateways", "2", "--params", str(params_file), "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--gateways 2" in done.stderr and "paths.database_url" in done.stderr
    assert not (tmp_path / "state" / "up").exists()  # nothing written, nothing started
