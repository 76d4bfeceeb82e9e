"""Helpers for the serving tests: a store per backend (SQLite, PostgreSQL), uvicorn on a loopback port."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.support.harness import serve_app, throwaway_schema

__all__ = ["post_completions", "serve_app", "store_url", "streamed_chunks"]


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


def streamed_chunks(url: str, key: str, prompt: str, **body) -> list[dict]:
    """POST /v1/completions with stream: true: the SSE chunks before `data: [DONE]` (checked to end the stream)."""
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": prompt, "stream": True, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
