"""tasks.core.procs: waiting for a started server says what went wrong when it never comes up."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core.procs import NotUp, free_port, wait_until_up

ROOT = Path(__file__).resolve().parents[1]


def test_up_when_the_server_answers_200():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/", proc, 30, interval_s=0.1)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_dies_is_reported_with_its_exit_code():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(NotUp, match="exited with 3"):
        wait_until_up(f"http://127.0.0.1:{free_port()}/healthz", proc, 30, interval_s=0.1)


def test_nothing_listening_times_out_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/healthz"
    with pytest.raises(NotUp, match=f"{url} did not answer within 1 s"):
        wait_until_up(url, None, 1.0, interval_s=0.1)


def test_any_status_accepts_a_404():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with pytest.raises(NotUp):
            wait_until_up(f"http://127.0.0.1:{port}/missing", proc, 2, interval_s=0.1)
        wait_until_up(f"http://127.0.0.1:{port}/missing", proc, 30, interval_s=0.1, any_status=True)
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_runs_the_finally_blocks_that_stop_child_servers():
    """A CLI that called exit_on_sigterm stops the server it started when it is killed with SIGTERM."""
    script = (
        "import subprocess, sys, time\n"
        "from tasks.core.procs import exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "try:\n"
        "    print(child.pid, flush=True)\n"  # inside the try: the signal comes after this line is read
        "    time.sleep(300)\n"
        "finally:\n"
        "    child.terminate()\n"
        "    child.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child_pid}"):
        time.sleep(0.1)  # terminated and reaped by the parent before it exited
    assert not os.path.exists(f"/proc/{child_pid}"), "the child server outlived its parent"
