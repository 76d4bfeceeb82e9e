"""What every route of one gateway app shares: the params, the store, the log writer, the router, who is
calling (the directory of keys), the metrics, the rate limiter, and the draws that choose which requests
explore. One per app; ``create_app`` builds it."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping

from fastapi import Request
from fastapi.responses import JSONResponse
from sqlalchemy.engine import Engine

from serving.auth import Caller, Directory, resolve_caller
from serving.limits import make_limiter
from serving.log import LogWriter
from serving.metrics import Metrics
from serving.router import Router
from tasks.core.config import Params
from tasks.core.engines.base import Backend
from tasks.core.store import Arm

log = logging.getLogger("tabrl.gateway")


class Gateway:
    """The state the routes share (see the module's docstring); the handlers are functions of it."""

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
        self.limiter = make_limiter(s)

    def ok(self, request: Request, body: dict) -> JSONResponse:
        self.metrics.requests.labels(request.url.path, "200").inc()
        return JSONResponse(body)

    async def caller_of(self, headers: Mapping[str, str], claimed_user: str | None) -> Caller:
        return await resolve_caller(headers, claimed_user, self.directory, self.require_auth)

    def fell_back(self, arm: Arm, err: Exception) -> None:
        log.warning("arm %r failed (%s); falling back to the champion", arm.name, err)
        self.metrics.fallbacks.labels(arm.name, arm.team).inc()
