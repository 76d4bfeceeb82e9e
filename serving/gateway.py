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
Run: ``tabrl serve`` (uvicorn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import sqlalchemy as sa
import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from sqlalchemy.engine import Engine

from serving.auth import Caller, Directory, RateLimiter, resolve_caller
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
from serving.errors import ApiError, error_body
from serving.log import (
    STORE_UNAVAILABLE,
    LogWriter,
    Outcome,
    Recorded,
    insert_completion,
    prompt_hash,
    record_outcome,
    suffix_form_prompt,
)
from serving.router import FimRequest, Router, UnknownArmError
from serving.store import Arm, init_schema, make_engine
from tasks.config import Params, ServingParams
from tasks.fim import TEMPLATES, FimFormatError, FimPrompt, parse_any
from tasks.generate import Generation

log = logging.getLogger("tabrl.gateway")

MAX_STOP_STRINGS = 32
MAX_RATE_WINDOWS = 100_000  # rate-limit windows kept before finished ones are dropped
RETRY_AFTER_S = 2  # Retry-After of a 503 while the log store is unavailable


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

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = JSONResponse(
                error_body(
                    413,
                    f"request body is {int(declared)} bytes; the limit is {self.max_bytes} (serving.max_body_bytes)",
                ),
                status_code=413,
            )
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(
                    413, f"request body exceeds the limit of {self.max_bytes} bytes (serving.max_body_bytes)"
                )
            return message

        return await self.app(scope, counted, send)


class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
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
        self.unlogged = Counter("tabrl_unlogged", "Requests served but not logged (opted out).", registry=self.registry)
        self._shown: dict[str, int] = {}
        self._accepted: dict[str, int] = {}

    def served(self, arm: str, shown: bool, seconds: float) -> None:
        self.completions.labels(arm, str(shown).lower()).inc()
        self.latency.labels(arm).observe(seconds)
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
        return generate_latest(self.registry)


@dataclass(frozen=True)
class CompletionInputs:
    """A completion request as the router takes it, and the prompt the editor's outcomes will quote."""

    request: FimRequest
    client_prompt: str  # the editor's prompt (prefix + suffix: their Qwen rendering), the key outcomes match on


def check_size(field: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise ApiError(413, f"{field} is {len(text)} characters; the limit is {limit}", field)


def normalise_request(req: CompletionRequest, s: ServingParams) -> CompletionInputs:
    """What an editor sent -> what the router takes: one prompt (a one-element list is fine), parsed in any
    FIM template tabrl knows or given as prefix (prompt) + suffix, the stop list, and sampling within the
    server's limits. Pure: raises ApiError (400, 413, 422) naming the field."""
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:
            raise ApiError(422, f"prompt: send one prompt per request (got a list of {len(req.prompt)})", "prompt")
        text = req.prompt[0]
    else:
        text = req.prompt
    check_size("prompt", text, s.max_prompt_chars)
    if req.suffix is not None:
        check_size("suffix", req.suffix, s.max_prompt_chars)
        source, fim, client_prompt = None, FimPrompt(text, req.suffix), suffix_form_prompt(text, req.suffix)
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
    return CompletionInputs(FimRequest(fim, source, stop, max_tokens, temperature, top_p), client_prompt)


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
        # Only the driver's own message: SQLAlchemy's str(err) carries the statement's parameters (prompts).
        reason = (
            f"{type(getattr(err, 'orig', None) or err).__name__}: {str(getattr(err, 'orig', None) or '').strip()[:200]}"
        )
        log.warning("log store unavailable (%s %s): %s", request.method, request.url.path, reason)
        return error(
            request,
            503,
            f"the log store is unavailable ({reason}); nothing was recorded, retry after {RETRY_AFTER_S} s",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    for kind in STORE_UNAVAILABLE:
        app.add_exception_handler(kind, _store_unavailable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for e in err.errors():
            if e["type"] == "json_invalid":
                problems.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e['msg'])}")
            else:
                loc = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
                problems.append(f"{loc}: {e['msg']}")
        return error(request, 422, "; ".join(problems))


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
        self.router = Router(engine, s.experiment_salt, s.config_ttl_s, s.backend_timeout_s, backend_factory)
        self.directory = Directory(engine, s.config_ttl_s)
        self.metrics = Metrics()
        self.limiter = RateLimiter(s.rate_limit_per_minute, s.rate_limit_per_key_per_minute, MAX_RATE_WINDOWS)

    def ok(self, request: Request, body: dict) -> JSONResponse:
        self.metrics.requests.labels(request.url.path, "200").inc()
        return JSONResponse(body)

    async def caller_of(self, request: Request, claimed_user: str | None) -> Caller:
        return await resolve_caller(request.headers, claimed_user, self.directory, self.require_auth)

    def fell_back(self, arm: Arm, err: Exception) -> None:
        log.warning("arm %r failed (%s); falling back to the champion", arm.name, err)
        self.metrics.fallbacks.labels(arm.name).inc()

    async def completions(self, req: CompletionRequest, request: Request):
        started = time.perf_counter()
        caller = await self.caller_of(request, req.user)
        inputs = normalise_request(req, self.s)
        self.limiter.check(caller)
        try:
            arm, champion = await self.router.route(caller.user_id, request.headers.get("x-tabrl-arm"))
        except UnknownArmError as err:
            raise ApiError(404 if request.headers.get("x-tabrl-arm") else 503, str(err), "X-Tabrl-Arm") from None
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
        created = int(time.time())
        tabrl = {"arm": arm.name, "model_version": arm.model_version, "logged": caller.logged}
        headers = {"X-Tabrl-Arm": arm.name}
        if req.stream:
            self.metrics.requests.labels(request.url.path, "200").inc()
            return StreamingResponse(
                _sse(completion_id, created, arm, gen, tabrl), media_type="text/event-stream", headers=headers
            )
        self.metrics.requests.labels(request.url.path, "200").inc()
        return JSONResponse(
            {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": arm.model_version,
                "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}],
                "usage": {"completion_tokens": len(gen.token_ids)},
                "tabrl": tabrl,
            },
            headers=headers,
        )

    async def record(self, request: Request, caller: Caller, outcome: Outcome, require_ours: bool) -> JSONResponse:
        if not caller.logged:
            return self.ok(request, {"logged": False})
        rec = await self.writer.submit(
            record_outcome(outcome, caller.user_id if caller.owner_checked else None, require_ours)
        )
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
        return self.ok(
            request,
            {
                "completion_id": rec.completion_id,
                "matched": rec.matched,
                "accepted": rec.accepted,
                "duplicate": rec.status == "duplicate",
                "logged": True,
            },
        )

    async def feedback_(self, req: FeedbackRequest, request: Request):
        caller = await self.caller_of(request, None)
        return await self.record(
            request,
            caller,
            Outcome(req.accepted, "api", req.completion_id, accepted_chars=req.accepted_chars),
            require_ours=True,
        )

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
        caller = await self.caller_of(request, None)
        try:
            outcome = outcome_from_rlinf(body)
        except CompatError as err:
            raise ApiError(422, str(err)) from None
        return await self.record(request, caller, outcome, require_ours=False)

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
        caller = await self.caller_of(request, None)
        try:
            outcome = outcome_from_continue(event.data, event.level, "continue")
        except CompatError as err:
            raise ApiError(422, str(err)) from None
        return await self.record(request, caller, outcome, require_ours=False)

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
        return self.ok(request, {"status": "ok", "arms": [a.name for a in arms], "auth": self.require_auth})

    async def metrics_(self, request: Request):
        self.metrics.requests.labels(request.url.path, "200").inc()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    params: Params,
    engine: Engine | None = None,
    auth: bool | None = None,
    backend_factory: Callable[[Arm, float], Backend] = make_backend,
) -> FastAPI:
    """The gateway app; auth=None follows params.serving.auth (switch it off only for a local demo).

    backend_factory builds an arm's backend (default: embedded or vLLM by the arm's `backend`);
    the benchmark passes its own to measure the gateway alone.
    """
    s = params.serving
    engine = engine if engine is not None else make_engine(params.paths.database_url, timeout_s=s.db_timeout_s)
    require_auth = s.auth if auth is None else auth
    gw = Gateway(params, engine, require_auth, backend_factory)
    writer, router, metrics = gw.writer, gw.router, gw.metrics

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        init_schema(engine)
        if s.seed is not None:  # (`tabrl serve` seeds from the OS when it is None)
            torch.manual_seed(s.seed)
            log.info("embedded arms sample with serving.seed=%d", s.seed)
        writer.start()
        log.info("gateway up: auth=%s, store=%s", require_auth, engine.url.render_as_string(hide_password=True))
        try:
            yield
        finally:
            writer.stop()
            await router.aclose()

    app = FastAPI(title="tabrl gateway", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=s.max_body_bytes)
    app.state.engine, app.state.router, app.state.metrics = engine, router, metrics

    install_error_handlers(app, metrics)

    app.post("/v1/completions")(gw.completions)
    app.post("/v1/feedback")(gw.feedback_)
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
    return app


def _json_body(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _sse(completion_id: str, created: int, arm: Arm, gen: Generation, tabrl: dict):
    """OpenAI-style SSE: the text, then the finish reason, then [DONE] (the row is already committed)."""
    base = {"id": completion_id, "object": "text_completion", "created": created, "model": arm.model_version}
    first = {
        **base,
        "choices": [{"text": gen.text, "index": 0, "logprobs": None, "finish_reason": None}],
        "tabrl": tabrl,
    }
    last = {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}]}
    yield f"data: {json.dumps(first)}\n\n"
    yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"
