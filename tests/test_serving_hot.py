"""HotRoutes (completions and feedback straight from ASGI) answers exactly as the FastAPI app does alone:
statuses, bodies, error messages, headers, SSE, the body limit and the metrics."""

from __future__ import annotations

import json

import httpx

from serving.auth import add_key
from serving.fast_path import HotRoutes
from serving.gateway import create_app
from tasks.core.store import Arm, Store, init_schema, replace_arms
from tests.conftest import tiny_params
from tests.serving_util import serve_app
from tests.support.harness import editor_prompt, fast_backend_factory

HEADERS = ("content-type", "x-tabrl-arm", "retry-after")


def _exchange(url: str, key: str) -> list:
    """The same requests, in order; ids from earlier answers are reused by later ones."""
    auth = {"Authorization": f"Bearer {key}"}
    out = []
    with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
        first = client.post("/v1/completions", json={"prompt": editor_prompt(0), "max_tokens": 4})
        cid = first.json()["id"]
        answers = [
            first,
            client.post("/v1/completions", json={"prompt": editor_prompt(1), "stream": True}),
            client.post("/v1/feedback", json={"completion_id": cid, "accepted": True}),
            client.post("/v1/feedback", json={"completion_id": cid, "accepted": True}),
            client.post("/v1/feedback", json={"completion_id": cid, "accepted": False}),
            client.post("/v1/feedback", json={"completion_id": "cmpl-nope", "accepted": True}),
            client.post("/v1/feedback", content=b"{nope", headers={"Content-Type": "application/json"}),
            client.post("/v1/completions", json={"prompt": editor_prompt(2), "temperature": -1, "n": 2}),
            client.post("/v1/completions", json={"prompt": "<|fim_prefix|>no suffix marker"}),
            client.post("/v1/completions", json={"prompt": "x", "suffix": "", "pad": "y" * 5000}),
            client.post("/v1/completions", json={"prompt": editor_prompt(3)}, headers={"Authorization": "Bearer no"}),
            client.post("/v1/completions", json={"prompt": editor_prompt(3)}, headers={"X-Tabrl-Arm": "nope"}),
            client.post("/v1/completions", json={"prompt": editor_prompt(4)}),  # the 4th counted: over the limit
        ]
        metrics = client.get("/metrics").text
    for r in answers:
        text = r.text.replace(cid, "CID")
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            body: object = [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]
            body = [body, text.rstrip().endswith("data: [DONE]")]
        else:
            body = {k: v for k, v in json.loads(text).items() if k not in ("id", "created")}
        out.append((r.status_code, body, {h: r.headers.get(h) for h in HEADERS}))
    counted = sorted(line for line in metrics.splitlines() if line.startswith('tabrl_requests_total{endpoint="/v1/'))
    return [*out, counted]


def test_hot_routes_answer_like_fastapi_alone(tmp_path):
    runs = []
    for name in ("hot", "fastapi"):
        params = tiny_params(
            tmp_path / name,
            serving={"config_ttl_s": 60, "max_body_bytes": 4096, "rate_limit_per_key_per_minute": 3},
        )
        engine = Store(params.paths.database_url).engine
        init_schema(engine)
        replace_arms(engine, [Arm("champion", "fast/1", "fast", "embedded", 1.0)])
        key = add_key(engine, "alice")
        app = create_app(params, engine=engine, auth=True, backend_factory=fast_backend_factory)
        assert isinstance(app, HotRoutes)
        with serve_app(app if name == "hot" else app.app) as url:
            runs.append(_exchange(url, key))
        engine.dispose()
    hot, alone = runs
    assert [a[0] for a in hot[:-1]] == [200, 200, 200, 200, 409, 404, 422, 422, 400, 413, 401, 404, 429]
    assert hot == alone
