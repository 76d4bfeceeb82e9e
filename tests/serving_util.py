"""Helpers for the serving tests: a store per backend (SQLite, PostgreSQL), uvicorn on a loopback port."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from serving.gateway import UVICORN_OPTIONS
from tasks.core.procs import free_port
from tests.support.harness import throwaway_schema


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


@contextmanager
def serve_app(app, timeout_s: float = 20.0):
    """Run an ASGI app with uvicorn in a thread on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", **UVICORN_OPTIONS))
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


def post_completions(url: str, key: str, prompts, timeout_s: float = 60.0, **body) -> list[httpx.Response]:
    """POST /v1/completions once per prompt as user `key`, each with the same extra body fields."""
    return [
        httpx.post(
            url + "/v1/completions",
            json={"prompt": p, **body},
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout_s,
        )
        for p in prompts
    ]
