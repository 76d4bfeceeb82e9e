"""A real `prefect server` on a free loopback port for one test (its own PREFECT_HOME), and the prefect CLI."""

import os
import signal
import subprocess
import sys

import pytest

from tasks.core.procs import free_port, wait_until_up


def prefect_cli(*args, env, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def prefect_server(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
    }
    env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/api/health", proc, 120)
        yield env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()
