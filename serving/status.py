"""GET /v1/models (the live arms), /healthz (the store answers) and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import os

import sqlalchemy as sa
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from serving.state import Gateway
from tasks.core.store import arms as arms_table


async def models(gw: Gateway, request: Request):
    """OpenAI's model list: a card per live arm (every team's), `created` when the arm went live; tabrl's own
    fields after OpenAI's."""
    arms = await gw.router.arms()

    def live_since() -> dict[tuple[str, str], float]:
        with gw.engine.connect() as conn:
            query = sa.select(arms_table.c.team, arms_table.c.name, arms_table.c.updated_at)
            return {(r.team, r.name): r.updated_at for r in conn.execute(query)}

    since = await asyncio.to_thread(live_since)
    return gw.ok(
        request,
        {
            "object": "list",
            "data": [
                {
                    "id": a.model_version,
                    "object": "model",
                    "created": int(since.get((a.team, a.name), 0)),
                    "owned_by": "tabrl",
                    "arm": a.name,
                    "team": a.team,
                    "backend": a.backend,
                    "share": a.share,
                }
                for a in arms
            ],
        },
    )


async def healthz(gw: Gateway, request: Request):
    arms = await gw.router.arms()

    def ping() -> None:
        with gw.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    await asyncio.to_thread(ping)
    # pid: which gateway process answered (replicas share a port: `tabrl serve --workers N`)
    return gw.ok(request, {"status": "ok", "arms": [a.name for a in arms], "auth": gw.require_auth, "pid": os.getpid()})


async def metrics(gw: Gateway, request: Request):
    gw.metrics.requests.labels(request.url.path, "200").inc()
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)
