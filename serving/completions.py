"""POST /v1/completions: who is calling, the request normalised, the rate limit, the arm chosen (sticky per
user, the champion when an arm fails), the suggestion committed to the log, then the answer.

A client that hangs up before the answer is sent (an editor aborts the request when the user types on) gets
no answer, and its row is stamped ``cancelled_at``: never shown, never counted, never trained on
(``tasks/core/outcomes.py``). A hang-up during generation stops it (the backend's task is cancelled: vLLM
aborts a request whose HTTP client went away, the embedded backend stops at its next token); one during the
commit marks the committed row. The boundary is the answer's first byte: a streamed answer is one chunk today
(``serving/protocol.py``), so "hung up before the first content chunk" is the same line.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

from serving.auth import Caller
from serving.errors import ApiError
from serving.fast_path import ClientGone, HangUp
from serving.log import insert_completion, mark_cancelled, prompt_hash
from serving.normalise import CompletionInputs, normalise_request
from serving.protocol import Answer, CompletionRequest, sse_events, usage
from serving.router import UnknownArmError
from serving.state import Gateway
from tasks.core.generate import Generation
from tasks.core.store import Arm
from tasks.core.teams import stored


async def completions(gw: Gateway, headers: Mapping[str, str], body: bytes, hang_up: HangUp) -> Answer:
    started = time.perf_counter()
    req = _served_request(body)
    caller = await gw.caller_of(headers, req.user)
    explore = gw.s.explore_fraction > 0 and gw.explore_draws.random() < gw.s.explore_fraction
    inputs = normalise_request(req, gw.s, explore)
    await gw.limiter.acquire(caller)
    forced = headers.get("x-tabrl-arm")
    try:
        routed, champion = await gw.router.route(caller.user_id, forced, caller.team)
    except UnknownArmError as err:
        raise ApiError(404 if forced else 503, str(err), "X-Tabrl-Arm") from None
    hang_up.watch()
    work = asyncio.ensure_future(gw.router.complete(routed, champion, inputs.request, gw.fell_back))
    gone = asyncio.ensure_future(hang_up.wait())
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    if work.done():
        arm, prompt, gen = work.result()
    else:  # the client hung up first: stop the generation
        work.cancel()
        finished = (await asyncio.gather(work, return_exceptions=True))[0]
        if not isinstance(finished, tuple):  # stopped (or failed) before it finished: log what was asked
            await _log_cancelled(gw, caller, completion_id, routed, inputs, started)
            raise ClientGone()
        arm, prompt, gen = finished  # its answer was ready as the cancel came: logged whole, as cancelled
    latency_ms = (time.perf_counter() - started) * 1000.0
    if caller.logged:
        seen = time.time() if hang_up.gone else None
        row = _row(completion_id, caller, arm, inputs, prompt, gen, latency_ms, cancelled_at=seen)
        await gw.writer.submit(insert_completion(row))
        if seen is None and hang_up.gone:  # it hung up while the row was committed
            await gw.writer.submit(mark_cancelled(completion_id, time.time()))
    else:
        gw.metrics.unlogged.inc()
    if hang_up.gone:
        gw.metrics.cancelled.labels(arm.name, arm.team).inc()
        raise ClientGone()
    gw.metrics.served(arm, bool(gen.text), time.perf_counter() - started)
    if explore:
        gw.metrics.explored.labels(arm.name, arm.team).inc()
    return _answer(req, completion_id, caller, arm, gen)


def _served_request(body: bytes) -> CompletionRequest:
    """The request, or 400 naming the OpenAI parameters it sets that this gateway does not serve (protocol.NEUTRAL)."""
    req = CompletionRequest.model_validate_json(body)
    refused = req.unsupported()
    if refused:
        raise ApiError(
            400,
            f"not served by this gateway: {', '.join(refused)} (leave them out or at OpenAI's defaults; "
            "docs/how-to/continue.md lists every parameter)",
            refused[0],
        )
    return req


def _answer(req: CompletionRequest, completion_id: str, caller: Caller, arm: Arm, gen: Generation) -> Answer:
    """OpenAI's answer (JSON, or server-sent events) and what the request log says of it."""
    created = int(time.time())
    tabrl = {"arm": arm.name, "model_version": arm.model_version, "logged": caller.logged}
    answer_headers = {"X-Tabrl-Arm": arm.name}
    record = {"completion_id": completion_id, "user": caller.user_id, "team": caller.team, "arm": arm.name}
    record |= {"arm_team": arm.team, "model_version": arm.model_version, "shown": bool(gen.text)}
    if req.stream:
        events = sse_events(completion_id, created, arm, gen, tabrl, req.include_usage)
        return Answer(200, {}, answer_headers, events, record)
    return Answer(
        200,
        {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": arm.model_version,
            "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}],
            "usage": usage(gen),
            "tabrl": tabrl,
        },
        answer_headers,
        record=record,
    )


def _row(
    completion_id: str,
    caller: Caller,
    arm: Arm,
    inputs: CompletionInputs,
    prompt: str,
    gen: Generation,
    latency_ms: float,
    cancelled_at: float | None = None,
) -> dict:
    return {
        "id": completion_id,
        "created_at": time.time(),
        "user_id": caller.user_id,
        "arm": arm.name,
        "model_version": arm.model_version,
        "prompt": prompt,  # as the arm's model saw it: training replays the same tokens
        "prefix": inputs.request.fim.prefix,
        "suffix": inputs.request.fim.suffix,
        "completion": gen.text,
        "token_ids": gen.token_ids,
        "logprobs": gen.logprobs,
        "temperature": inputs.request.temperature,
        "latency_ms": latency_ms,
        "abstained": not gen.text,
        "prompt_hash": prompt_hash(inputs.client_prompt, gen.text),
        "cancelled_at": cancelled_at,
        "reports_outcomes": caller.reports_outcomes,
        "team": stored(caller.team),
        "arm_team": stored(arm.team),
    }


async def _log_cancelled(
    gw: Gateway, caller: Caller, completion_id: str, arm: Arm, inputs: CompletionInputs, started: float
) -> None:
    """The row of a request whose client hung up during generation: what was asked, nothing generated (the
    prompt was never rendered for the model, and the suggestion never finished)."""
    gw.metrics.cancelled.labels(arm.name, arm.team).inc()
    if not caller.logged:
        gw.metrics.unlogged.inc()
        return
    latency_ms = (time.perf_counter() - started) * 1000.0  # until the hang-up was seen
    nothing = Generation(text="", token_ids=[], logprobs=[])
    row = _row(completion_id, caller, arm, inputs, "", nothing, latency_ms, cancelled_at=time.time())
    await gw.writer.submit(insert_completion({**row, "token_ids": None, "logprobs": None}))
