"""What the benchmarks and the hardening tests share: a backend that answers at once, the gateway in its
own process, throwaway stores, simulated editors under load and the store checks after them.

    python -m tests.support.harness gateway --db URL --port P [--no-auth] [--workers N] [--set KEY=VALUE ...]
    python -m tests.support.harness bare --port P

* ``gateway``: the real gateway app in its own process (so it can be SIGKILLed). Arms whose backend
  is ``embedded`` answer with ``FastBackend`` (a fixed 8-token Generation, at once: load, fuzz and
  the benchmarks measure the gateway and the store, not model generation); ``vllm`` arms use the
  real ``VLLMBackend`` over HTTP.
* ``bare``: the same ``FastBackend`` behind a bare FastAPI route, on the same uvicorn settings as
  ``tabrl serve``: what the gateway's added cost is measured against.

Benchmarks import from here, never from ``tests/``; the tests import from here too.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tasks.core.engines.base import Sampling
from tasks.core.fim import QWEN, FimTemplate
from tasks.core.generate import Generation
from tasks.core.procs import NotUp, free_port, wait_until_up
from tasks.core.store import Arm, completions, feedback

ROOT = Path(__file__).resolve().parents[2]


class FastBackend:
    """A real Backend that answers at once (the gateway's own cost is what is measured)."""

    def __init__(self, arm: Arm, timeout_s: float):
        self.arm = arm

    async def template(self) -> FimTemplate:
        return QWEN

    async def complete(self, prompt: str, sampling: Sampling, on_text=None) -> Generation:
        """The same suggestion every time, shown whole (a show rule is the model's business, not measured here)."""
        return Generation(
            text="return a + b",
            token_ids=[11, 12, 13, 14, 15, 16, 17, 0],
            logprobs=[-0.1, -0.2, -0.05, -0.3, -0.1, -0.2, -0.1, -0.01],
            raw_text="return a + b",
        )

    async def aclose(self) -> None:
        return None


class DelayedBackend:
    """A real backend whose answers come `delay_s` later: how the benches and tests give one arm the latency of a
    slower model without changing what it suggests. The delay follows the generation, so a client that hangs up
    during it finds the suggestion made: the gateway logs it whole (as cancelled), as an older gateway logged
    every suggestion, and what the old rule would have counted is exact."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    async def template(self) -> FimTemplate:
        return await self.inner.template()

    async def complete(self, prompt: str, sampling: Sampling, on_text=None) -> Generation:
        gen = await self.inner.complete(prompt, sampling, on_text)  # a stream's pieces come as the model makes them
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            return gen  # the model had finished: its answer was only on its way (see the class docstring)
        return gen

    async def aclose(self) -> None:
        await self.inner.aclose()


def delayed_factory(delays_s: dict[str, float], factory=None):
    """A backend factory that delays each arm's answers by delays_s[arm name] (0 when not named)."""
    from tasks.core.engines import make_backend

    build = make_backend if factory is None else factory

    def make(arm: Arm, timeout_s: float):
        inner = build(arm, timeout_s)
        delay = delays_s.get(arm.name, 0.0)
        return DelayedBackend(inner, delay) if delay > 0 else inner

    return make


def slow_challenger_gateway(params, model_dir: Path, slow_s: float, challenger_version: str):
    """(engine, gateway app) over a fresh store at params' database: the champion and a challenger on the same
    embedded weights, half the traffic each, the challenger under its own served name (its own backend, on the same
    loaded weights) with its answers slow_s later. Auth off."""
    from serving.gateway import create_app
    from tasks.core.store import CHALLENGER, CHAMPION, Store, init_schema, replace_arms

    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(
        engine,
        [
            Arm(CHAMPION, "tiny/1", str(model_dir), "embedded", 0.5),
            Arm(CHALLENGER, challenger_version, str(model_dir), "embedded", 0.5, served_model="slow"),
        ],
    )
    return engine, create_app(params, engine=engine, auth=False, backend_factory=delayed_factory({CHALLENGER: slow_s}))


class VllmStandIn:
    """A real HTTP server on loopback that speaks vLLM's /v1/models and /v1/completions (token ids, log-probs;
    streamed as server-sent events, one token a chunk, when asked) and answers every request after `hold_s`, at
    most `max_running` at a time (the rest queue, as in a busy vLLM, a streamed one with its headers sent and no
    token yet). A request whose client goes away while it is held is aborted, as vLLM aborts it: `aborted` counts
    them, `served` the answered ones. For tests of what reaches a slow or busy server."""

    MODEL = "qwen2.5-coder-stand-in"  # a name Continue (and tabrl) read as Qwen2.5-Coder's FIM template

    def __init__(self, hold_s: float, max_running: int = 64, text: str = "return a + b"):
        self.hold_s, self.max_running, self.text = hold_s, max_running, text
        self.served = 0
        self.aborted = 0
        self.running = 0
        self.most_running = 0

    def app(self) -> FastAPI:
        app = FastAPI()
        slots = asyncio.Semaphore(self.max_running)
        tokens = [word if i == 0 else f" {word}" for i, word in enumerate(self.text.split())]
        ids = list(range(11, 11 + len(tokens)))

        def choice(texts: list[str], token_ids: list[int], finish: str | None) -> dict:
            logprobs = {"token_logprobs": [-0.05] * len(token_ids), "tokens": texts}
            return {"index": 0, "text": "".join(texts), "finish_reason": finish, "token_ids": token_ids} | {
                "logprobs": logprobs
            }

        def answer(choices: list[dict]) -> dict:
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": self.MODEL} | {
                "choices": choices
            }

        async def held(request: Request | None) -> bool:
            """Hold a slot for hold_s; False when the client went away meanwhile (a streamed one is cancelled)."""
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                deadline = time.monotonic() + self.hold_s
                while time.monotonic() < deadline:
                    if request is not None and await request.is_disconnected():
                        self.aborted += 1
                        return False
                    await asyncio.sleep(min(0.01, max(deadline - time.monotonic(), 0)))
                return True
            except asyncio.CancelledError:
                self.aborted += 1
                raise
            finally:
                self.running -= 1

        async def stream():
            async with slots:
                if not await held(None):
                    return
            self.served += 1
            for i, (token, token_id) in enumerate(zip(tokens, ids, strict=True)):
                finish = "stop" if i == len(tokens) - 1 else None
                yield f"data: {json.dumps(answer([choice([token], [token_id], finish)]))}\n\n"
            yield "data: [DONE]\n\n"

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.MODEL, "object": "model"}]}

        @app.post("/v1/completions")
        async def complete(request: Request):
            if (await request.json()).get("stream"):
                return StreamingResponse(stream(), media_type="text/event-stream")
            async with slots:
                if not await held(request):
                    return {}
            self.served += 1
            return answer([choice(tokens, ids, "stop")])

        return app


@contextmanager
def serve_app(app, timeout_s: float = 20.0):
    """Run an ASGI app with uvicorn in a thread on a free loopback port; yields its base URL."""
    import uvicorn

    from serving.gateway import UVICORN_OPTIONS

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", **UVICORN_OPTIONS))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def fast_backend_factory(arm: Arm, timeout_s: float):
    from tasks.core.engines import make_backend

    return make_backend(arm, timeout_s) if arm.backend == "vllm" else FastBackend(arm, timeout_s)


DELAYS_ENV = "TABRL_HARNESS_DELAYS"  # `gateway --delay ARM=S`: the arms' delays (JSON) for its app factory


def _serve_gateway(
    db_url: str,
    port: int,
    auth: bool,
    overrides: list[str],
    workers: int,
    params_file: str | None = None,
    delays: dict[str, float] | None = None,
) -> None:
    from serving.gateway import serve
    from tasks.core.config import load_params
    from tasks.core.store import Store, init_schema

    auth_off = [] if auth else ["serving.auth=false"]
    params = load_params(params_file, [f"paths.database_url={db_url}", *overrides, *auth_off], environ={})
    engine = Store(db_url, timeout_s=params.serving.db_timeout_s).engine
    init_schema(engine)
    engine.dispose()
    factory = "tests.support.harness:gateway_from_env"
    if delays is not None:
        os.environ[DELAYS_ENV] = json.dumps(delays)
        factory = "tests.support.harness:delayed_gateway_from_env"
    serve(params, "127.0.0.1", port, workers, factory=factory)


def gateway_from_env():
    """uvicorn's app factory in each gateway process: the real gateway, with FastBackend for embedded arms."""
    from serving.gateway import create_app, params_from_env

    return create_app(params_from_env(), backend_factory=fast_backend_factory)


def delayed_gateway_from_env():
    """The app factory of `gateway --delay ARM=S`: the real gateway with its real backends, each named arm's
    answers delayed (DelayedBackend)."""
    from serving.gateway import create_app, params_from_env

    delays = json.loads(os.environ[DELAYS_ENV])
    return create_app(params_from_env(), backend_factory=delayed_factory(delays))


def _serve_bare(port: int) -> None:
    import uvicorn

    from serving.gateway import UVICORN_OPTIONS

    app = FastAPI()
    backend = FastBackend(Arm("bare", "bare", "", "embedded", 1.0), 1.0)

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        gen = await backend.complete(body.get("prompt", ""), Sampling(8, 0.7))
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "choices": [{"text": gen.text, "index": 0, "finish_reason": "stop"}],
        }

    @app.post("/v1/feedback")
    async def feedback_(request: Request):
        body = await request.json()
        return {"completion_id": body.get("completion_id"), "accepted": body.get("accepted"), "logged": False}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": []}

    uvicorn.run(app, host="127.0.0.1", port=port, **UVICORN_OPTIONS)


@contextmanager
def throwaway_schema(base_url: str) -> Iterator[str]:
    """URL of a fresh PostgreSQL schema in base_url's database (tests run side by side), dropped after."""
    schema = f"t_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base_url, pool_pre_ping=True)  # the drop reconnects after a server restart (a soak's)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{base_url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@contextmanager
def bench_stores(postgres_url: str | None, prefix: str):
    """{"sqlite": a fresh file} plus {"postgres": a throwaway schema} when postgres_url is given (dropped after)."""
    stores = {"sqlite": f"sqlite:///{tempfile.mkdtemp(prefix=f'tabrl-{prefix}-')}/{prefix}.db"}
    if not postgres_url:
        yield stores
        return
    with throwaway_schema(postgres_url) as schema_url:
        yield stores | {"postgres": schema_url}


def start_process(
    kind: str,
    port: int,
    *args: str,
    module: str = "tests.support.harness",
    ready_path: str = "/v1/models",
    timeout_s: float = 60.0,
) -> subprocess.Popen:
    """Start `python -m MODULE KIND` on port and wait until ready_path answers (any status)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", module, kind, "--port", str(port), *args], cwd=ROOT, env=env)
    try:
        wait_until_up(f"http://127.0.0.1:{port}{ready_path}", proc, timeout_s, interval_s=0.2, any_status=True)
    except NotUp as err:
        proc.kill()
        raise RuntimeError(f"{kind} process: {err}") from err
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- load


def editor_prompt(i: int) -> str:
    return QWEN.render(f"def f{i}(a, b):\n    ", f"\n\nprint(f{i}(1, 2))\n")


@dataclass
class LoadResult:
    requests: int = 0  # completion requests sent
    latencies_ms: list[float] = field(default_factory=list)  # of acknowledged (200) completions
    statuses: Counter = field(default_factory=Counter)  # completion + feedback answers by status ("conn" = no answer)
    acked: dict[str, str] = field(default_factory=dict)  # completion id -> user, for every 200 completion
    acked_arms: Counter = field(default_factory=Counter)
    acked_feedback: dict[str, bool] = field(default_factory=dict)  # completion id -> accepted, for every 200 feedback
    elapsed_s: float = 0.0

    @property
    def errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)

    def summary(self) -> dict:
        lat = sorted(self.latencies_ms)
        return {
            "requests": self.requests,
            "acked_completions": len(self.acked),
            "acked_feedback": len(self.acked_feedback),
            "errors": self.errors,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
            "elapsed_s": round(self.elapsed_s, 3),
            "completions_per_s": len(self.acked) / self.elapsed_s if self.elapsed_s else 0.0,
            "events_per_s": (len(self.acked) + len(self.acked_feedback)) / self.elapsed_s if self.elapsed_s else 0.0,
            "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99),
        }


def percentile(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def drive_editors(
    url: str,
    editors: list[tuple[str, str | None]],
    total: int,
    feedback_rate: float = 0.7,
    seed: int = 0,
    timeout_s: float = 10.0,
    pause_on_error_s: float = 0.05,
    on_progress=None,
) -> LoadResult:
    """`len(editors)` concurrent editors (user, API key or None) share `total` completion requests.

    Each: request a completion; when it is acknowledged, send feedback (accepted at random) with
    probability feedback_rate, else stay silent. Every acknowledged id and answer is recorded so the
    store can be checked afterwards. on_progress(result) is called after each completion answer.
    """
    result = LoadResult()
    counter = iter(range(total))
    rng = random.Random(seed)

    async def editor(client: httpx.AsyncClient, user: str, key: str | None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {"X-Tabrl-User": user}
        for i in counter:
            result.requests += 1
            started = time.perf_counter()
            try:
                r = await client.post(
                    "/v1/completions", headers=headers, json={"prompt": editor_prompt(i), "max_tokens": 8, "user": user}
                )
            except httpx.HTTPError:
                result.statuses["conn"] += 1
                await asyncio.sleep(pause_on_error_s)
                continue
            result.statuses[r.status_code] += 1
            if on_progress is not None:
                on_progress(result)
            if r.status_code != 200:
                await asyncio.sleep(pause_on_error_s)
                continue
            result.latencies_ms.append((time.perf_counter() - started) * 1000.0)
            body = r.json()
            if body["tabrl"]["logged"]:
                result.acked[body["id"]] = user
                result.acked_arms[body["tabrl"]["arm"]] += 1
            if rng.random() >= feedback_rate:
                continue
            accepted = rng.random() < 0.5
            try:
                f = await client.post(
                    "/v1/feedback", headers=headers, json={"completion_id": body["id"], "accepted": accepted}
                )
            except httpx.HTTPError:
                result.statuses["conn"] += 1
                continue
            result.statuses[f.status_code] += 1
            if f.status_code == 200 and f.json().get("logged"):
                result.acked_feedback[body["id"]] = accepted

    limits = httpx.Limits(max_connections=len(editors), max_keepalive_connections=len(editors))
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*[editor(client, user, key) for user, key in editors])
        result.elapsed_s = time.perf_counter() - started
    return result


def store_problems(engine: sa.Engine, result: LoadResult, arms: set[str] | None = None) -> list[str]:
    """Everything wrong with the store after a load: lost acknowledged rows, changed answers, invalid rows."""
    problems: list[str] = []
    with engine.connect() as conn:
        rows = conn.execute(sa.select(completions)).mappings().all()
        answers = dict(conn.execute(sa.select(feedback.c.completion_id, feedback.c.accepted)).all())
    stored = {r["id"]: r for r in rows}
    lost = [cid for cid in result.acked if cid not in stored]
    if lost:
        problems.append(f"{len(lost)} acknowledged completions missing from the store, e.g. {lost[:3]}")
    wrong_user = [cid for cid, user in result.acked.items() if cid in stored and stored[cid]["user_id"] != user]
    if wrong_user:
        problems.append(f"{len(wrong_user)} completions stored under another user, e.g. {wrong_user[:3]}")
    lost_fb = [cid for cid in result.acked_feedback if cid not in answers]
    if lost_fb:
        problems.append(f"{len(lost_fb)} acknowledged feedback rows missing, e.g. {lost_fb[:3]}")
    changed = [cid for cid, acc in result.acked_feedback.items() if cid in answers and answers[cid] != acc]
    if changed:
        problems.append(f"{len(changed)} feedback answers differ from the acknowledged ones, e.g. {changed[:3]}")
    problems += row_problems(rows, arms)
    return problems


def row_problems(rows, arms: set[str] | None = None) -> list[str]:
    """Completion rows that are not well formed (the fuzz and load checks share this)."""
    bad = []
    for r in rows:
        ids, lps = r["token_ids"], r["logprobs"]
        why = None
        if not str(r["id"]).startswith("cmpl-"):
            why = "id"
        elif not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            why = "token ids / log-probs"
        elif not all(isinstance(t, int) for t in ids) or not all(isinstance(x, float) and x <= 0 for x in lps):
            why = "token id or log-prob values"
        elif hashlib.sha256(f"{r['prompt']}\0{r['completion']}".encode()).hexdigest() != r["prompt_hash"]:
            why = "prompt hash"
        elif r["abstained"] != (not r["completion"]):
            why = "abstained flag"
        elif arms is not None and r["arm"] not in arms:
            why = f"arm {r['arm']!r}"
        if why:
            bad.append(f"completion {r['id']}: bad {why}")
    return bad[:10]


def make_keys(db_url: str, users: int, prefix: str = "editor") -> list[tuple[str, str]]:
    """(user, API key) for `users` editors, created in the store (schema first)."""
    from serving.auth import add_key
    from tasks.core.store import Store, init_schema

    engine = Store(db_url).engine
    try:
        init_schema(engine)
        return [(f"{prefix}-{i}", add_key(engine, f"{prefix}-{i}")) for i in range(users)]
    finally:
        engine.dispose()


def seed_arms(db_url: str, arms: list[Arm]) -> None:
    from tasks.core.store import Store, init_schema, replace_arms

    engine = Store(db_url).engine
    try:
        init_schema(engine)
        replace_arms(engine, arms)
    finally:
        engine.dispose()


def run_load(db_url: str, users: int, total: int, feedback_rate: float = 0.7, seed: int = 0) -> tuple[dict, list[str]]:
    """The gateway in its own process on db_url, `users` editors (auth on) sharing `total` requests;
    returns (summary, store problems)."""
    from tasks.core.store import Store

    seed_arms(db_url, [Arm("champion", "fast/1", "fast", "embedded", 1.0)])
    editors = make_keys(db_url, users)
    port = free_port()
    proc = start_process(
        "gateway",
        port,
        "--db",
        db_url,
        "--set",
        "serving.rate_limit_per_minute=1000000",
        "--set",
        "serving.rate_limit_per_key_per_minute=1000000",
    )
    try:
        result = asyncio.run(drive_editors(f"http://127.0.0.1:{port}", editors, total, feedback_rate, seed))
    finally:
        stop_process(proc)
    engine = Store(db_url).engine
    try:
        problems = store_problems(engine, result, {"champion"})
        with engine.connect() as conn:
            stored = conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar()
            stored_fb = conn.execute(sa.select(sa.func.count()).select_from(feedback)).scalar()
    finally:
        engine.dispose()
    if stored != len(result.acked) or stored_fb != len(result.acked_feedback):
        problems.append(
            f"store holds {stored} completions / {stored_fb} feedback; acknowledged "
            f"{len(result.acked)} / {len(result.acked_feedback)}"
        )
    return {**result.summary(), "users": users, "stored_completions": stored, "stored_feedback": stored_fb}, problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["gateway", "bare"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--db", default="")
    parser.add_argument("--no-auth", action="store_true")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--params", default=None, help="A params file (default: the code's defaults).")
    parser.add_argument(
        "--delay", action="append", default=None, help="ARM=SECONDS: real backends, this arm's answers delayed."
    )
    args = parser.parse_args()
    if args.kind == "gateway":
        delays = None if args.delay is None else {a: float(s) for a, _, s in (d.partition("=") for d in args.delay)}
        _serve_gateway(args.db, args.port, not args.no_auth, args.set, args.workers, args.params, delays)
    else:
        _serve_bare(args.port)


if __name__ == "__main__":
    main()
