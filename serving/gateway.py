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

This module is the app factory and ``serve``; each other job has its module: ``protocol`` (request and
response models), ``normalise``, ``errors``, ``fast_path`` (``HotRoutes``, the body limit),
``metrics``, ``state`` (what the routes share), ``completions``, ``feedback`` (the outcome routes),
``status`` (models, health, metrics), ``auth`` (who is calling) and ``limits`` (rate limits).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from sqlalchemy.engine import Engine

from serving.compat import ContinueEvent, RlinfSubmit
from serving.completions import completions as complete
from serving.errors import install_error_handlers
from serving.fast_path import BodyLimit, HotRoutes, fastapi_route
from serving.feedback import continue_events, rlinf_submit
from serving.feedback import feedback as record_feedback
from serving.logs import configure as configure_logs
from serving.metrics import MULTIPROC_ENV, multiprocess_dir
from serving.protocol import CompletionRequest, ContinueData, FeedbackRequest
from serving.state import Gateway
from serving.status import healthz, models
from serving.status import metrics as render_metrics
from tasks.core.config import Params
from tasks.core.engines import make_backend
from tasks.core.engines.base import Backend
from tasks.core.store import Arm, Store, init_schema

log = logging.getLogger("tabrl.gateway")

# How uvicorn runs the gateway: the event loop and HTTP parser in C (uvloop, httptools). Python's own
# (asyncio, h11) cost more CPU per request than the gateway's work (docs/lab, "Gateway").
UVICORN_OPTIONS: dict = {"loop": "uvloop", "http": "httptools", "log_level": "warning", "access_log": False}


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
    engine = engine if engine is not None else Store(params.paths.database_url, s.db_timeout_s).engine
    require_auth = s.auth if auth is None else auth
    gw = Gateway(params, engine, require_auth, backend_factory)
    completions, feedback = partial(complete, gw), partial(record_feedback, gw)
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
        ("/v1/completions", completions, CompletionRequest),
        ("/v1/feedback", feedback, FeedbackRequest),
    ):
        app.post(path, openapi_extra=_json_body(_documented(app, model)))(fastapi_route(handler, metrics))
    # These two routes parse their bodies by hand (lenient, size-checked first); the schemas are for the docs
    # and the fuzzer.
    rlinf_schema = _json_body(RlinfSubmit.model_json_schema())
    app.post("/api/training/submit", openapi_extra=rlinf_schema)(_route(rlinf_submit, gw))
    app.post("/api/continue/events", openapi_extra=_json_body(_continue_schema()))(_route(continue_events, gw))
    app.get("/v1/models")(_route(models, gw))
    app.get("/healthz")(_route(healthz, gw))
    app.get("/metrics")(_route(render_metrics, gw, "metrics_"))
    return HotRoutes(app, {"/v1/completions": completions, "/v1/feedback": feedback}, s.max_body_bytes, metrics)


PARAMS_ENV = "TABRL_GATEWAY_PARAMS"  # the resolved params (JSON), from `tabrl serve` to its gateway processes


def serve(params: Params, host: str, port: int, workers: int, factory: str = "serving.gateway:app_from_env") -> None:
    """Run the gateway with uvicorn until stopped: `workers` processes on one port (uvicorn's supervisor
    restarts one that dies), each building its app with `factory` (an import string) from the resolved params
    handed over in the environment. Replicas share the log store and, with serving.redis_url, the rate limits; their
    metrics are summed through a directory under paths.state_dir (prometheus_client's multiprocess mode)."""
    if workers > 1 and not params.serving.redis_url:
        raise ValueError(
            f"{workers} gateway processes would each count the rate limits on their own; "
            "set serving.redis_url (e.g. --set serving.redis_url=redis://127.0.0.1:6379/0) or run one"
        )
    os.environ[PARAMS_ENV] = params.model_dump_json()
    if workers > 1:  # /metrics sums every process's counters (serving/metrics.py)
        os.environ[MULTIPROC_ENV] = str(multiprocess_dir(Path(params.paths.state_dir)))
    uvicorn.run(factory, factory=True, host=host, port=port, workers=workers, **UVICORN_OPTIONS)


def params_from_env() -> Params:
    raw = os.environ.get(PARAMS_ENV)
    if raw is None:
        raise RuntimeError(f"{PARAMS_ENV} is not set: start the gateway with `tabrl serve`")
    return Params.model_validate_json(raw)


def app_from_env() -> HotRoutes:
    """uvicorn's app factory in each gateway process of `tabrl serve`."""
    params = params_from_env()
    configure_logs(params.serving.log_format)
    if params.serving.seed is None:  # torch's default seed is the same in every fresh process: draw one
        log.info("embedded arms sample with seed %d (set serving.seed to fix it)", torch.seed())
    return create_app(params)


def _json_body(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _documented(app: FastAPI, model: type[BaseModel]) -> dict:
    """model's JSON schema for a hand-declared request body, its nested models (`stream_options`) moved into the
    document's components, where their references point: pydantic's own `#/$defs/...` would resolve to nothing
    in an OpenAPI document (the docs page and the fuzzer could not read the body)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    nested = schema.pop("$defs", {})
    if nested:
        generate = app.openapi

        def openapi() -> dict:
            document = generate()
            document.setdefault("components", {}).setdefault("schemas", {}).update(nested)
            return document

        app.openapi = openapi  # type: ignore[method-assign]
    return schema


def _continue_schema() -> dict:
    """Continue's envelope with its autocomplete event as `data` (for the docs and the fuzzer)."""
    envelope = ContinueData.model_json_schema(by_alias=True)
    return {**envelope, "properties": {**envelope["properties"], "data": ContinueEvent.model_json_schema()}}


def _route(handler: Callable, gw: Gateway, name: str = "") -> partial:
    """handler(gw, request) as a FastAPI endpoint of request, under the handler's name (the OpenAPI operation)."""
    route = partial(handler, gw)
    route.__name__ = name or handler.__name__  # type: ignore[attr-defined]
    route.__doc__ = handler.__doc__
    return route
