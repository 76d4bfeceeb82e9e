"""Child servers on loopback: a free port, and waiting for a started process to answer.

Used by the gateway the online loop starts, the vLLM arms, the training job's rendezvous, the
benchmarks and the tests: one way to say "started" for all of them.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx


class NotUp(RuntimeError):
    """A started process that died, or did not answer in time; the message says which."""


def free_port() -> int:
    """A loopback TCP port nobody listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(
    url: str, proc: subprocess.Popen | None, timeout_s: float, interval_s: float = 0.5, any_status: bool = False
) -> None:
    """Poll url until it answers 200 (any status with any_status), proc exits, or timeout_s passes.

    Raises NotUp naming the URL and what happened; the caller decides whether to kill proc."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NotUp(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200 or any_status:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(interval_s)
    raise NotUp(f"{url} did not answer within {timeout_s:.0f} s")


def exit_on_sigterm() -> None:
    """Make SIGTERM (`kill`, a scheduler's stop) exit through the `finally` blocks, like Ctrl-C does.

    Python's default SIGTERM ends the process at once, leaving the servers it started (the gateway of
    the online loop, Prefect's temporary server) running as orphans. Call once, from a CLI's main."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
