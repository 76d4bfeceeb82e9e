"""The gateway editors talk to: OpenAI-compatible completions, feedback, A/B arms, a durable log.

    POST /v1/completions      FIM prompt (plain or Continue's repo-level form) or prompt + suffix;
                              the response id is the completion id; stream=true gives SSE + [DONE]
    POST /v1/feedback         {completion_id, accepted, accepted_chars?}
    POST /api/training/submit RLinf's Continue fork outcome body
    POST /api/continue/events upstream Continue's HTTP `data` destination (schema 0.2.0)
    GET  /v1/models, /healthz, /metrics (Prometheus)

Every served suggestion is committed to the log store (``serving.log.LogWriter``, group commit)
before its response is sent. Users who opted out, and requests with ``X-Tabrl-Opt-Out: 1``, are
served and not logged. ``X-Tabrl-Arm: NAME`` pins a request to one arm (debugging, evaluation).

The two routes every suggestion takes, completions and feedback, are plain functions of (headers,
body) that return an ``Answer``; ``HotRoutes`` serves them straight from ASGI, and the FastAPI app
behind it serves everything else (and documents all routes). Run: ``tabrl serve`` (uvicorn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa
import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from sqlalchemy.engine import Engine

from serving.auth import Caller, Directory, RateLimiter, RedisRateLimiter, resolve_caller
from serving.backends import Backend, make_backend
from serving.compat import (
    CONTINUE_SCHEMA,
    CompatError,
    ContinueEvent,
    RlinfSubmit,
    outcome_from_continue,
    outcome_from_rlinf,
    texts_of,
)
from serving.errors import RETRY_AFTER_S, ApiError, error_body
from serving.log import (
    STORE_UNAVAILABLE,
    LogWriter,
    Outcome,
    Recorded,
    RecordFeedback,
    insert_completion,
    prompt_hash,
    record_outcome,
    suffix_form_prompt,
)
from serving.router import FimRequest, Router, UnknownArmError
from tasks.core.config import Params, ServingParams
from tasks.core.fim import TEMPLATES, FimFormatError, FimPrompt, parse_any
from tasks.core.generate import Generation, show_rule
from tasks.core.store import Arm, init_schema, make_engine

log = logging.getLogger("tabrl.gateway")

MAX_STOP_STRINGS = 32
MAX_RATE_WINDOWS = 100_000  # rate-limit windows kept before finished ones are dropped
LATENCY_QUANTILES = (0.5, 0.95)  # the per-arm latency quantiles /metrics shows (tabrl_arm_latency_ms)
# How uvicorn runs the gateway: the event loop and HTTP parser in C (uvloop, httptools). Python's own
# (asyncio, h11) cost more CPU per request than the gateway's work (bench/RESULTS.md, "Gateway").
UVICORN_OPTIONS: dict = {"loop": "uvloop", "http": "httptools", "log_level": "warning", "access_log": False}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send more fields (presence_penalty, echo, ...)

    model: str | None = None
    prompt: str | list[str]
    suffix: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = Field(None, max_length=128)
    n: int = Field(1, ge=1, le=1)


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    completion_id: str = Field(min_length=1, max_length=128)
    accepted: StrictBool
    accepted_chars: int | None = Field(None, ge=0)


class ContinueData(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    data: dict
    schema_: str = Field(alias="schema")
    level: str = "all"
    profileId: str | None = None


class BodyLimit:
    """ASGI middleware: refuse a request body over max_bytes with 413 before anything parses it.

    A declared Content-Length is checked up front; a chunked body is counted as it arrives."""

    def __init__(self, app, max_bytes: int, metrics: Metrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            check_declared_size(declared.decode("latin-1") if declared is not None else None, self.max_bytes)
        except ApiError as err:
            self.metrics.requests.labels(scope["path"], "413").inc()
            return await JSONResponse(error_body(413, err.message), status_code=413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, body_too_large(self.max_bytes))
            return message

        return await self.app(scope, counted, send)


def check_declared_size(content_length: str | None, max_bytes: int) -> None:
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise ApiError(
            413, f"request body is {int(content_length)} bytes; the limit is {max_bytes} (serving.max_body_bytes)"
        )


def body_too_large(max_bytes: int) -> str:
    return f"request body exceeds the limit of {max_bytes} bytes (serving.max_body_bytes)"


class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process).

    Latency per arm twice: the histogram `tabrl_completion_latency_seconds` (buckets, since start, for
    PromQL's histogram_quantile across replicas) and the gauge `tabrl_arm_latency_ms{arm, quantile}`: p50
    and p95 of the arm's last `latency_window` completions in this process, read directly. The gauge is
    computed when /metrics is read (`render`), so serving a request only appends to a bounded deque."""

    def __init__(self, latency_window: int) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tabrl_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"], registry=self.registry
        )
        self.completions = Counter(
            "tabrl_completions",
            "Completions served by arm (shown or abstained).",
            ["arm", "shown"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tabrl_completion_latency_seconds",
            "Completion latency in the gateway by arm.",
            ["arm"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.latency_quantiles = Gauge(
            "tabrl_arm_latency_ms",
            f"Completion latency in the gateway by arm, quantile of its last {latency_window} completions "
            "in this process (serving.latency_window), in milliseconds.",
            ["arm", "quantile"],
            registry=self.registry,
        )
        self.feedback = Counter(
            "tabrl_feedback",
            "Outcomes recorded by arm ('' when unmatched) and answer.",
            ["arm", "accepted"],
            registry=self.registry,
        )
        self.accept_rate = Gauge(
            "tabrl_online_accept_rate",
            "Accepted / shown suggestions per arm since start.",
            ["arm"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "tabrl_fallbacks", "Requests a failing arm handed to the champion.", ["arm"], registry=self.registry
        )
        self.explored = Counter(
            "tabrl_explored", "Requests cut at serving.explore_min_logprob, by arm.", ["arm"], registry=self.registry
        )
        self.unlogged = Counter("tabrl_unlogged", "Requests served but not logged (opted out).", registry=self.registry)
        self._shown: dict[str, int] = {}
        self._accepted: dict[str, int] = {}
        self._latency_window = latency_window
        self._recent_ms: dict[str, deque[float]] = {}  # arm -> its last latency_window latencies (ms)

    def served(self, arm: str, shown: bool, seconds: float) -> None:
        self.completions.labels(arm, str(shown).lower()).inc()
        self.latency.labels(arm).observe(seconds)
        recent = self._recent_ms.get(arm)
        if recent is None:
            recent = self._recent_ms[arm] = deque(maxlen=self._latency_window)
        recent.append(seconds * 1000.0)
        if shown:
            self._shown[arm] = self._shown.get(arm, 0) + 1

    def recorded(self, rec: Recorded) -> None:
        if rec.status != "recorded":
            return
        self.feedback.labels(rec.arm or "", str(rec.accepted).lower()).inc()
        if rec.accepted and rec.arm:
            self._accepted[rec.arm] = self._accepted.get(rec.arm, 0) + 1

    def render(self) -> bytes:
        for arm, shown in self._shown.items():
            self.accept_rate.labels(arm).set(self._accepted.get(arm, 0) / shown)
        for arm, recent in self._recent_ms.items():
            for q, value in zip(LATENCY_QUANTILES, latency_quantiles(recent, LATENCY_QUANTILES), strict=True):
                self.latency_quantiles.labels(arm, f"{q:g}").set(value)
        return generate_latest(self.registry)


def latency_quantiles(latencies_ms: Iterable[float], quantiles: Sequence[float]) -> list[float]:
    """Quantiles of the latencies, linearly interpolated between the closest ranks (numpy's default, PostgreSQL's
    percentile_cont; `tabrl ab-status` computes the same from the log store). Needs at least one latency."""
    return [float(v) for v in np.quantile(np.fromiter(latencies_ms, dtype=float), quantiles)]


@dataclass(frozen=True)
class CompletionInputs:
    """A completion request as the router takes it, and the prompt the editor's outcomes will quote."""

    request: FimRequest
    client_prompt: str  # the editor's prompt (prefix + suffix: their Qwen rendering), the key outcomes match on


def check_size(field: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise ApiError(413, f"{field} is {len(text)} characters; the limit is {limit}", field)


def normalise_request(req: CompletionRequest, s: ServingParams, explore: bool = False) -> CompletionInputs:
    """What an editor sent -> what the router takes: one prompt (a one-element list is fine), parsed in any
    FIM template tabrl knows, or given as prefix (prompt) + suffix, or a plain prompt (no FIM marker: a prefix
    with an empty suffix, as any OpenAI completions client sends); the stop list, and sampling within the
    server's limits; explore: cut at serving.explore_min_logprob. Pure: raises ApiError (400, 413, 422)
    naming the field (400: a prompt that starts a FIM template and breaks it)."""
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:
            raise ApiError(422, f"prompt: send one prompt per request (got a list of {len(req.prompt)})", "prompt")
        text = req.prompt[0]
    else:
        text = req.prompt
    check_size("prompt", text, s.max_prompt_chars)
    if req.suffix is not None or not any(t.marks(text) for t in TEMPLATES.values()):
        # prefix + suffix, or a plain OpenAI completion (no FIM marker, no suffix): the prefix, nothing after it
        suffix = req.suffix or ""
        check_size("suffix", suffix, s.max_prompt_chars)
        source, fim, client_prompt = None, FimPrompt(text, suffix), suffix_form_prompt(text, suffix)
    else:
        try:
            source, fim = parse_any(text)
        except FimFormatError as err:
            raise ApiError(
                400,
                f"{err}; send a FIM prompt in one of {', '.join(TEMPLATES)} "
                "(the prefix-only form: the prefix as prompt plus `suffix`)",
                "prompt",
            ) from None
        client_prompt = text
    stop = [req.stop] if isinstance(req.stop, str) else (list(req.stop) if req.stop else None)
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise ApiError(422, f"stop: at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})", "stop")
    max_tokens = min(req.max_tokens or s.max_tokens, s.max_tokens)  # clients ask for more than a FIM line needs
    temperature = s.temperature if req.temperature is None else req.temperature
    top_p = s.top_p if req.top_p is None else req.top_p
    return CompletionInputs(
        FimRequest(fim, source, stop, max_tokens, temperature, top_p, show_rule(s, explore)), client_prompt
    )


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error the gateway answers, in the OpenAI error shape, counted by endpoint and status."""

    def error(
        request: Request, status: int, message: str, param: str | None = None, headers: dict | None = None
    ) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(status)).inc()
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return error(request, err.status, err.message, err.param, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        return error(request, err.status_code, str(err.detail), headers=err.headers)

    async def _store_unavailable(request: Request, err: Exception) -> JSONResponse:
        answer = store_unavailable(err, f"{request.method} {request.url.path}")
        return error(request, answer.status, answer.body["error"]["message"], headers=answer.headers)

    for kind in STORE_UNAVAILABLE:
        app.add_exception_handler(kind, _store_unavailable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return error(request, 422, validation_message(err.errors()))

    @app.exception_handler(ValidationError)  # a hot route's body, validated by the handler itself
    async def _invalid_body(request: Request, err: ValidationError) -> JSONResponse:
        return error(request, 422, validation_message(err.errors()))


def validation_message(errors: Any) -> str:
    """pydantic's errors as one line naming each field ("malformed JSON body: ..." when it is not JSON)."""
    problems = []
    for e in errors:
        if e["type"] == "json_invalid":
            problems.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e['msg'])}")
        else:
            loc = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
            problems.append(f"{loc}: {e['msg']}")
    return "; ".join(problems)


def store_unavailable(err: Exception, what: str) -> Answer:
    """503 + Retry-After: the log store could not take the write (locked, unreachable); nothing was recorded."""
    # Only the driver's own message: SQLAlchemy's str(err) carries the statement's parameters (prompts).
    driver = getattr(err, "orig", None)
    reason = f"{type(driver or err).__name__}: {str(driver or '').strip()[:200]}"
    log.warning("log store unavailable (%s): %s", what, reason)
    message = f"the log store is unavailable ({reason}); nothing was recorded, retry after {RETRY_AFTER_S} s"
    return Answer(503, error_body(503, message), {"Retry-After": str(RETRY_AFTER_S)})


@dataclass(frozen=True)
class Answer:
    """What a hot route answers, before any framework renders it: a JSON body, or server-sent events."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)
    events: tuple[dict, ...] = ()  # when given: streamed as SSE `data:` lines, then `data: [DONE]`


def encode_json(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def sse_chunks(events: tuple[dict, ...]) -> list[bytes]:
    return [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [b"data: [DONE]\n\n"]


def error_answer(err: Exception, what: str) -> Answer:
    """The OpenAI-shaped answer to an error a hot route expects (ANSWERED); what: "METHOD /path" for the log."""
    if isinstance(err, ApiError):
        return Answer(err.status, error_body(err.status, err.message, err.param), err.headers or {})
    if isinstance(err, ValidationError):
        return Answer(422, error_body(422, validation_message(err.errors())))
    return store_unavailable(err, what)


ANSWERED = (ApiError, ValidationError, *STORE_UNAVAILABLE)  # errors a hot route turns into a 4xx/5xx answer
Handler = Callable[[Mapping[str, str], bytes], Awaitable[Answer]]


class ClientGone(Exception):
    """The client disconnected before its request body arrived: there is no one to answer."""


class HotRoutes:
    """ASGI in front of the FastAPI app: POST /v1/completions and /v1/feedback, the two routes every suggestion
    takes, go straight to their handlers; everything else goes to FastAPI (which also documents these two).

    FastAPI's middleware, routing, dependency solving and response classes cost more CPU per request than the
    gateway's own work (bench/RESULTS.md, "Gateway"). Here a request costs its headers made a dict, its body
    read against serving.max_body_bytes, one handler call and two sends; the answers, errors and metrics are
    the same as FastAPI's."""

    def __init__(self, app: Any, routes: dict[str, Handler], max_body_bytes: int, metrics: Metrics):
        self.app, self.routes, self.max_body_bytes, self.metrics = app, routes, max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))  # the first of repeated headers
        try:
            body = await self._body(receive, headers.get("content-length"))
            answer = await handler(headers, body)
        except ClientGone:
            return
        except ANSWERED as err:
            answer = error_answer(err, f"POST {scope['path']}")
        self.metrics.requests.labels(scope["path"], str(answer.status)).inc()
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()]
        if answer.events:
            start = [(b"content-type", b"text/event-stream; charset=utf-8"), *extra]
            await send({"type": "http.response.start", "status": answer.status, "headers": start})
            for chunk in sse_chunks(answer.events):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        content = encode_json(answer.body)
        start = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()), *extra]
        await send({"type": "http.response.start", "status": answer.status, "headers": start})
        await send({"type": "http.response.body", "body": content})

    async def _body(self, receive, content_length: str | None) -> bytes:
        check_declared_size(content_length, self.max_body_bytes)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, body_too_large(self.max_body_bytes))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def as_response(answer: Answer) -> Response:
    """An Answer as a Starlette response: the same hot routes when FastAPI serves them (without HotRoutes)."""
    if answer.events:
        return StreamingResponse(
            iter(sse_chunks(answer.events)), answer.status, answer.headers, media_type="text/event-stream"
        )
    return Response(encode_json(answer.body), answer.status, answer.headers, media_type="application/json")


class Gateway:
    """What the routes do: serve a completion, record an outcome, answer health and metrics. One per app;
    ``create_app`` wires its methods to routes."""

    def __init__(
        self,
        params: Params,
        engine: Engine,
        require_auth: bool,
        backend_factory: Callable[[Arm, float], Backend],
    ):
        self.s = s = params.serving
        self.engine, self.require_auth = engine, require_auth
        self.writer = LogWriter(engine, s.log_batch)
        self.router = Router(
            engine,
            s.experiment_salt,
            s.config_ttl_s,
            s.backend_timeout_s,
            backend_factory,
            (s.window_chars, s.window_step_chars),
        )
        self.directory = Directory(engine, s.config_ttl_s)
        self.metrics = Metrics(s.latency_window)
        self.explore_draws = random.Random(s.seed)  # which requests explore (serving.explore_fraction)
        self.limiter = (
            RedisRateLimiter(s.redis_url, s.rate_limit_per_minute, s.rate_limit_per_key_per_minute, s.db_timeout_s)
            if s.redis_url
            else RateLimiter(s.rate_limit_per_minute, s.rate_limit_per_key_per_minute, MAX_RATE_WINDOWS)
        )

    def ok(self, request: Request, body: dict) -> JSONResponse:
        self.metrics.requests.labels(request.url.path, "200").inc()
        return JSONResponse(body)

    async def caller_of(self, headers: Mapping[str, str], claimed_user: str | None) -> Caller:
        return await resolve_caller(headers, claimed_user, self.directory, self.require_auth)

    def fell_back(self, arm: Arm, err: Exception) -> None:
        log.warning("arm %r failed (%s); falling back to the champion", arm.name, err)
        self.metrics.fallbacks.labels(arm.name).inc()

    async def completions(self, headers: Mapping[str, str], body: bytes) -> Answer:
        started = time.perf_counter()
        req = CompletionRequest.model_validate_json(body)
        caller = await self.caller_of(headers, req.user)
        explore = self.s.explore_fraction > 0 and self.explore_draws.random() < self.s.explore_fraction
        inputs = normalise_request(req, self.s, explore)
        await self.limiter.acquire(caller)
        forced = headers.get("x-tabrl-arm")
        try:
            arm, champion = await self.router.route(caller.user_id, forced)
        except UnknownArmError as err:
            raise ApiError(404 if forced else 503, str(err), "X-Tabrl-Arm") from None
        arm, prompt, gen = await self.router.complete(arm, champion, inputs.request, self.fell_back)
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        latency_ms = (time.perf_counter() - started) * 1000.0
        if caller.logged:
            await self.writer.submit(
                insert_completion(
                    {
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
                    }
                )
            )
        else:
            self.metrics.unlogged.inc()
        self.metrics.served(arm.name, bool(gen.text), time.perf_counter() - started)
        if explore:
            self.metrics.explored.labels(arm.name).inc()
        created = int(time.time())
        tabrl = {"arm": arm.name, "model_version": arm.model_version, "logged": caller.logged}
        answer_headers = {"X-Tabrl-Arm": arm.name}
        if req.stream:
            return Answer(200, {}, answer_headers, _sse_events(completion_id, created, arm, gen, tabrl))
        return Answer(
            200,
            {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": arm.model_version,
                "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}],
                "usage": {"completion_tokens": len(gen.token_ids)},
                "tabrl": tabrl,
            },
            answer_headers,
        )

    async def record(self, caller: Caller, outcome: Outcome, require_ours: bool) -> dict:
        """Store an outcome; the success body, or ApiError (404 unknown, 403 another user's, 409 a changed answer).
        require_ours: by our completion id only (/v1/feedback), recorded with the group commit's others at once."""
        if not caller.logged:
            return {"logged": False}
        owner = caller.user_id if caller.owner_checked else None
        op = RecordFeedback(outcome, owner) if require_ours else record_outcome(outcome, owner, require_ours=False)
        rec = await self.writer.submit(op)
        self.metrics.recorded(rec)
        if rec.status == "unknown":
            raise ApiError(
                404,
                f"unknown completion id {outcome.completion_id!r} (not served by this gateway, or opted out)",
                "completion_id",
            )
        if rec.status == "forbidden":
            raise ApiError(
                403,
                f"completion {rec.completion_id!r} belongs to another user; a key may only send feedback "
                "for its own completions",
                "completion_id",
            )
        if rec.status == "conflict":
            raise ApiError(
                409,
                f"feedback for {rec.completion_id!r} was already recorded as accepted={rec.accepted}; "
                "the first answer wins",
                "accepted",
            )
        return {
            "completion_id": rec.completion_id,
            "matched": rec.matched,
            "accepted": rec.accepted,
            "duplicate": rec.status == "duplicate",
            "logged": True,
        }

    async def feedback(self, headers: Mapping[str, str], body: bytes) -> Answer:
        req = FeedbackRequest.model_validate_json(body)
        caller = await self.caller_of(headers, None)
        outcome = Outcome(req.accepted, "api", req.completion_id, accepted_chars=req.accepted_chars)
        return Answer(200, await self.record(caller, outcome, require_ours=True))

    async def json_object(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(422, f"malformed JSON body: {err}") from None
        if not isinstance(body, dict):
            raise ApiError(422, f"body must be a JSON object, got {type(body).__name__}")
        return body

    # These two routes parse their bodies by hand (lenient, size-checked first); the schemas are for the docs
    # and the fuzzer.
    async def rlinf_submit(self, request: Request):
        body = await self.json_object(request)
        for name, text in texts_of(body).items():
            check_size(name, text, self.s.max_text_chars if name != "prompt" else self.s.max_prompt_chars)
        caller = await self.caller_of(request.headers, None)
        try:
            outcome = outcome_from_rlinf(body)
        except CompatError as err:
            raise ApiError(422, str(err)) from None
        return self.ok(request, await self.record(caller, outcome, require_ours=False))

    async def continue_events(self, request: Request):
        envelope = await self.json_object(request)
        try:
            event = ContinueData.model_validate(envelope)
        except ValueError as err:
            raise ApiError(422, f"not a Continue data event ({{name, data, schema, level}}): {err}") from None
        if event.schema_ != CONTINUE_SCHEMA:
            raise ApiError(
                422,
                f"schema {event.schema_!r} is not supported; set `schema: {CONTINUE_SCHEMA}` on the data destination",
                "schema",
            )
        if event.name != "autocomplete":
            return self.ok(request, {"ignored": True, "reason": f"event {event.name!r} is not used by tabrl"})
        for name, text in texts_of(event.data).items():
            check_size(f"data.{name}", text, self.s.max_text_chars if name != "prompt" else self.s.max_prompt_chars)
        caller = await self.caller_of(request.headers, None)
        try:
            outcome = outcome_from_continue(event.data, event.level, "continue")
        except CompatError as err:
            raise ApiError(422, str(err)) from None
        return self.ok(request, await self.record(caller, outcome, require_ours=False))

    async def models(self, request: Request):
        arms = await self.router.arms()
        return self.ok(
            request,
            {
                "object": "list",
                "data": [
                    {
                        "id": a.model_version,
                        "object": "model",
                        "owned_by": "tabrl",
                        "arm": a.name,
                        "backend": a.backend,
                        "share": a.share,
                    }
                    for a in arms
                ],
            },
        )

    async def healthz(self, request: Request):
        arms = await self.router.arms()

        def ping() -> None:
            with self.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))

        await asyncio.to_thread(ping)
        # pid: which gateway process answered (replicas share a port: `tabrl serve --workers N`)
        return self.ok(
            request, {"status": "ok", "arms": [a.name for a in arms], "auth": self.require_auth, "pid": os.getpid()}
        )

    async def metrics_(self, request: Request):
        self.metrics.requests.labels(request.url.path, "200").inc()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    params: Params,
    engine: Engine | None = None,
    auth: bool | None = None,
    backend_factory: Callable[[Arm, float], Backend] = make_backend,
) -> HotRoutes:
    """The gateway app (ASGI); auth=None follows params.serving.auth (switch it off only for a local demo).

    backend_factory builds an arm's backend (default: embedded or vLLM by the arm's `backend`);
    the benchmark passes its own to measure the gateway alone. The FastAPI app is its `.app`.
    """
    s = params.serving
    engine = engine if engine is not None else make_engine(params.paths.database_url, timeout_s=s.db_timeout_s)
    require_auth = s.auth if auth is None else auth
    gw = Gateway(params, engine, require_auth, backend_factory)
    writer, router, metrics = gw.writer, gw.router, gw.metrics

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        init_schema(engine)
        if s.seed is not None:  # (`tabrl serve`'s processes seed from the OS when it is None)
            torch.manual_seed(s.seed)
            log.info("embedded arms sample with serving.seed=%d", s.seed)
        writer.start()
        log.info(
            "gateway up: auth=%s, store=%s, rate limits %s",
            require_auth,
            engine.url.render_as_string(hide_password=True),
            "in Redis (shared by replicas)" if s.redis_url else "in this process",
        )
        try:
            yield
        finally:
            writer.stop()
            await router.aclose()
            await gw.limiter.aclose()

    app = FastAPI(title="tabrl gateway", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=s.max_body_bytes, metrics=metrics)
    app.state.engine, app.state.router, app.state.metrics = engine, router, metrics

    install_error_handlers(app, metrics)

    # Served by HotRoutes; declared here too, so FastAPI documents them (and serves them when it runs alone).
    for path, handler, model in (
        ("/v1/completions", gw.completions, CompletionRequest),
        ("/v1/feedback", gw.feedback, FeedbackRequest),
    ):
        app.post(path, openapi_extra=_json_body(model.model_json_schema()))(_fastapi_route(handler, metrics))
    # These two routes parse their bodies by hand (lenient, size-checked first); the schemas are for the docs
    # and the fuzzer.
    app.post("/api/training/submit", openapi_extra=_json_body(RlinfSubmit.model_json_schema()))(gw.rlinf_submit)
    app.post(
        "/api/continue/events",
        openapi_extra=_json_body(
            {
                **ContinueData.model_json_schema(by_alias=True),
                "properties": {
                    **ContinueData.model_json_schema(by_alias=True)["properties"],
                    "data": ContinueEvent.model_json_schema(),
                },
            }
        ),
    )(gw.continue_events)
    app.get("/v1/models")(gw.models)
    app.get("/healthz")(gw.healthz)
    app.get("/metrics")(gw.metrics_)
    return HotRoutes(app, {"/v1/completions": gw.completions, "/v1/feedback": gw.feedback}, s.max_body_bytes, metrics)


PARAMS_ENV = "TABRL_GATEWAY_PARAMS"  # the resolved params (JSON), from `tabrl serve` to its gateway processes


def serve(params: Params, host: str, port: int, workers: int, factory: str = "serving.gateway:app_from_env") -> None:
    """Run the gateway with uvicorn until stopped: `workers` processes on one port (uvicorn's supervisor
    restarts one that dies), each building its app with `factory` (an import string) from the resolved params
    handed over in the environment. Replicas share the log store and, with serving.redis_url, the rate limits."""
    if workers > 1 and not params.serving.redis_url:
        raise ValueError(
            f"{workers} gateway processes would each count the rate limits on their own; "
            "set serving.redis_url (e.g. --set serving.redis_url=redis://127.0.0.1:6379/0) or run one"
        )
    os.environ[PARAMS_ENV] = params.model_dump_json()
    uvicorn.run(factory, factory=True, host=host, port=port, workers=workers, **UVICORN_OPTIONS)


def params_from_env() -> Params:
    raw = os.environ.get(PARAMS_ENV)
    if raw is None:
        raise RuntimeError(f"{PARAMS_ENV} is not set: start the gateway with `tabrl serve`")
    return Params.model_validate_json(raw)


def app_from_env() -> HotRoutes:
    """uvicorn's app factory in each gateway process of `tabrl serve`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    params = params_from_env()
    if params.serving.seed is None:  # torch's default seed is the same in every fresh process: draw one
        log.info("embedded arms sample with seed %d (set serving.seed to fix it)", torch.seed())
    return create_app(params)


def _fastapi_route(handler: Handler, metrics: Metrics) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:  # errors go to the app's handlers, which count them
        answer = await handler(request.headers, await request.body())
        metrics.requests.labels(request.url.path, str(answer.status)).inc()
        return as_response(answer)

    return route


def _json_body(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _sse_events(completion_id: str, created: int, arm: Arm, gen: Generation, tabrl: dict) -> tuple[dict, ...]:
    """OpenAI-style SSE: the text, then the finish reason (then [DONE]); the row is already committed."""
    base = {"id": completion_id, "object": "text_completion", "created": created, "model": arm.model_version}
    first = {
        **base,
        "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": None}],
        "tabrl": tabrl,
    }
    last = {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}]}
    return (first, last)
