"""An evaluation on a slow vLLM server is slower and never fails; only a stalled one does (issue 54).

The evaluation's engine (`tasks.core.inference.VllmEngine`) keeps many requests in flight so that vLLM batches
them. On a slow CPU most of them wait in the server's queue: a timeout counted from sending killed the last of
them (`VllmError: ... ReadTimeout` at the first SmolLM2 batch on a 2-core AVX2 EPYC). The answers are streamed
now, and the batch fails only when the server streams no token to any of its requests for
serving.vllm_request_timeout_s. The server here is a real HTTP server on loopback speaking vLLM's completions
API (`tests.support.harness.VllmStandIn`) that serves one request at a time, 0.2 s each.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tasks.core.fim import QWEN
from tasks.core.inference import VLLM_IN_FLIGHT, VllmEngine
from tasks.core.vllm import VllmError, completion_body
from tests.support.harness import VllmStandIn, serve_app

HOLD_S = 0.2  # the server's time per request, one at a time
TIMEOUT_S = 5.0  # serving.vllm_request_timeout_s for these tests: 25 requests' worth of the server's time
REQUESTS = 100


def test_an_evaluation_of_100_requests_on_a_server_that_runs_one_at_a_time_gets_every_answer():
    server = VllmStandIn(hold_s=HOLD_S, max_running=1)
    prompts = [f"<|fim_prefix|>def f{i}(a, b):\n    <|fim_suffix|>\n<|fim_middle|>" for i in range(REQUESTS)]
    with serve_app(server.app()) as url:
        engine = VllmEngine(url, server.MODEL, QWEN, QWEN.stops, stall_s=TIMEOUT_S)
        started = time.monotonic()
        generations = engine.complete(prompts, max_new_tokens=16)
        took = time.monotonic() - started
    assert [g.text for g in generations] == [server.text] * REQUESTS
    assert all(len(g.token_ids) == len(g.logprobs) == 4 for g in generations)  # the streamed tokens, joined
    assert server.served == REQUESTS and server.aborted == 0 and server.most_running == 1
    assert took >= REQUESTS * HOLD_S  # the server's own pace: most requests waited far past TIMEOUT_S to start
    print(f"{REQUESTS} requests at {HOLD_S} s each, one at a time: {took:.1f} s, every answer")


def test_the_same_evaluation_with_a_timeout_counted_from_sending_fails():
    """What the engine did before: VLLM_IN_FLIGHT requests sent at once, each timed from sending. On this server
    the ones queued behind the first 25 run out of time before it starts them."""
    server = VllmStandIn(hold_s=HOLD_S, max_running=1)
    body = completion_body(server.MODEL, "def f(a, b):", 16, 0.0, 1.0, QWEN.stops, 0)

    async def send_all(url: str) -> list:
        limits = httpx.Limits(max_connections=VLLM_IN_FLIGHT)
        async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, pool=None), limits=limits) as client:
            posts = (client.post(f"{url}/v1/completions", json=body) for _ in range(REQUESTS))
            return await asyncio.gather(*posts, return_exceptions=True)

    with serve_app(server.app()) as url:
        results = asyncio.run(send_all(url))
    timed_out = sum(isinstance(r, httpx.TimeoutException) for r in results)
    assert timed_out >= VLLM_IN_FLIGHT - TIMEOUT_S / HOLD_S - 2, f"only {timed_out} of {REQUESTS} timed out"


def test_a_stalled_server_fails_the_evaluation_naming_the_param():
    server = VllmStandIn(hold_s=60.0, max_running=1)  # takes a request and streams nothing back
    with serve_app(server.app()) as url:
        engine = VllmEngine(url, server.MODEL, QWEN, QWEN.stops, stall_s=1.0)
        started = time.monotonic()
        with pytest.raises(VllmError, match="stalled.*serving.vllm_request_timeout_s"):
            engine.complete(["def f(a, b):"] * 3, max_new_tokens=16)
        assert time.monotonic() - started < 10
    assert server.served == 0
