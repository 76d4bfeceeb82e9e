"""Helpers for the serving tests: a store per backend (SQLite, PostgreSQL), uvicorn on a loopback port."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from tests.conftest import throwaway_schema


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    """A fresh log store URL: SQLite in tmp, or a throwaway schema in TABRL_TEST_POSTGRES_URL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/tabrl.db"
        return
    url = os.environ.get("TABRL_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("PostgreSQL store skipped: set TABRL_TEST_POSTGRES_URL to run it")
    with throwaway_schema(url) as schema_url:
        yield schema_url


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_app(app, timeout_s: float = 20.0):
    """Run an ASGI app with uvicorn in a thread on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def wait_http(url: str, timeout_s: float, proc=None) -> None:
    """Poll url until it answers 200 (or the process dies / time runs out)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")
