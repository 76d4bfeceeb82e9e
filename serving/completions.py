"""POST /v1/completions: who is calling, the request normalised, the rate limit, the arm chosen (sticky per
user, the champion when an arm fails), the suggestion committed to the log, then the answer.

A client that hangs up before its answer is complete (an editor aborts the request when the user types on) gets
its row stamped ``cancelled_at``: never shown, never counted, never trained on (``tasks/core/outcomes.py``). A
hang-up during generation stops it (the backend's task is cancelled: vLLM aborts a request whose HTTP client went
away, the embedded backend stops at its next token); one during the commit marks the committed row.

Streamed (`stream: true`), the suggestion's settled pieces are sent as the model makes them (both backends): only
text that is certainly shown, held back until the stop strings and the show rule have settled
(``tasks/core/streaming.py``). The logged row is the same as unstreamed, and the invariant is: the row is committed
before the stream's last chunk (what is left of the suggestion and its finish reason) is sent, so a client that read
the whole answer holds a committed row; one that hung up before was logged cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from serving.auth import Caller
from serving.errors import ApiError, error_body
from serving.fast_path import ClientGone, HangUp
from serving.log import insert_completion, mark_cancelled, prompt_hash
from serving.normalise import CompletionInputs, normalise_request
from serving.protocol import Answer, CompletionRequest, text_chunk, usage
from serving.router import UnknownArmError
from serving.state import Gateway
from tasks.core.generate import Generation
from tasks.core.store import Arm
from tasks.core.teams import stored

log = logging.getLogger("tabrl.gateway")


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
    request = _Request(gw, caller, inputs, routed, champion, hang_up, f"cmpl-{uuid.uuid4().hex}", started, explore)
    if req.stream:  # its headers and record are filled as it streams
        headers_out: dict[str, str] = {}
        record: dict = {}
        return Answer(200, {}, headers_out, record, _streamed(req, request, headers_out, record))
    arm, gen = await request.settle()
    return _answer(req, request.completion_id, caller, arm, gen)


@dataclass
class _Request:
    """One completion request on its way: generated on the routed arm (the champion when it fails), then logged."""

    gw: Gateway
    caller: Caller
    inputs: CompletionInputs
    routed: Arm
    champion: Arm
    hang_up: HangUp
    completion_id: str
    started: float
    explore: bool

    async def settle(self, on_text: Callable[[Arm, str], None] | None = None) -> tuple[Arm, Generation]:
        """Generate (on_text: the settled pieces as they come), then commit the row; ClientGone when the client hung
        up first (the row logged as cancelled)."""
        gw, caller, inputs = self.gw, self.caller, self.inputs
        work = asyncio.ensure_future(
            gw.router.complete(self.routed, self.champion, inputs.request, gw.fell_back, on_text)
        )
        gone = asyncio.ensure_future(self.hang_up.wait())
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if work.done():
            arm, prompt, gen = work.result()
        else:  # the client hung up first: stop the generation
            work.cancel()
            finished = (await asyncio.gather(work, return_exceptions=True))[0]
            if not isinstance(finished, tuple):  # stopped (or failed) before it finished: log what was asked
                await _log_cancelled(gw, caller, self.completion_id, self.routed, inputs, self.started)
                raise ClientGone()
            arm, prompt, gen = finished  # its answer was ready as the cancel came: logged whole, as cancelled
        latency_ms = (time.perf_counter() - self.started) * 1000.0
        if caller.logged:
            seen = time.time() if self.hang_up.gone else None
            row = _row(self.completion_id, caller, arm, inputs, prompt, gen, latency_ms, cancelled_at=seen)
            await gw.writer.submit(insert_completion(row))
            if seen is None and self.hang_up.gone:  # it hung up while the row was committed
                await gw.writer.submit(mark_cancelled(self.completion_id, time.time()))
        else:
            gw.metrics.unlogged.inc()
        if self.hang_up.gone:
            gw.metrics.cancelled.labels(arm.name, arm.team).inc()
            raise ClientGone()
        gw.metrics.served(arm, bool(gen.text), time.perf_counter() - self.started)
        if self.explore:
            gw.metrics.explored.labels(arm.name, arm.team).inc()
        return arm, gen


async def _streamed(
    req: CompletionRequest, request: _Request, headers: dict[str, str], record: dict
) -> AsyncIterator[dict]:
    """The events of a streamed answer: each settled piece of the suggestion as it is generated (the first with the
    tabrl block; `X-Tabrl-Arm` set before it), then, once the row is committed, what is left of the suggestion, the
    finish reason and (include_usage) the usage. An error before the first piece is answered as any error; one after
    it ends the stream with an error event."""
    created, sent = int(time.time()), ""
    pieces: asyncio.Queue[tuple[Arm, str]] = asyncio.Queue()
    settle = asyncio.ensure_future(request.settle(lambda arm, piece: pieces.put_nowait((arm, piece))))
    usage_field = {"usage": None} if req.include_usage else {}

    def chunk(arm: Arm, text: str) -> dict:
        first = {"tabrl": _tabrl(arm, request.caller)} if not sent else {}
        if not sent:
            headers["X-Tabrl-Arm"] = arm.name
        return text_chunk(request.completion_id, created, arm.model_version, text, first | usage_field)

    try:
        while True:
            getter = asyncio.ensure_future(pieces.get())
            await asyncio.wait((getter, settle), return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            arm, piece = getter.result()
            event = chunk(arm, piece)
            sent += piece
            yield event
        try:
            arm, gen = settle.result()
        except ApiError as err:
            if not sent:
                raise
            yield error_body(err.status, err.message, err.param)
            return
    finally:
        if not settle.done():  # closed early (the connection went): the generation stops, its row logged cancelled
            request.hang_up.set()
            await asyncio.gather(settle, return_exceptions=True)
    if not gen.text.startswith(sent):
        log.warning("%s: streamed %r is not a prefix of the suggestion %r", request.completion_id, sent, gen.text)
    rest = gen.text[len(sent) :] if gen.text.startswith(sent) else ""
    if rest or not sent:
        yield chunk(arm, rest)
    base = {"id": request.completion_id, "object": "text_completion", "created": created, "model": arm.model_version}
    finish = [{"text": "", "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}]
    yield {**base, "choices": finish, **usage_field}
    if req.include_usage:
        yield {**base, "choices": [], "usage": usage(gen)}
    record.update(_record(request.completion_id, request.caller, arm, gen))


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


def _tabrl(arm: Arm, caller: Caller) -> dict:
    return {"arm": arm.name, "model_version": arm.model_version, "logged": caller.logged}


def _record(completion_id: str, caller: Caller, arm: Arm, gen: Generation) -> dict:
    """What the request log says of an answered completion (serving/logs.py)."""
    record = {"completion_id": completion_id, "user": caller.user_id, "team": caller.team, "arm": arm.name}
    return record | {"arm_team": arm.team, "model_version": arm.model_version, "shown": bool(gen.text)}


def _answer(req: CompletionRequest, completion_id: str, caller: Caller, arm: Arm, gen: Generation) -> Answer:
    """OpenAI's answer, JSON, and what the request log says of it."""
    created = int(time.time())
    tabrl = _tabrl(arm, caller)
    answer_headers = {"X-Tabrl-Arm": arm.name}
    record = _record(completion_id, caller, arm, gen)
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
