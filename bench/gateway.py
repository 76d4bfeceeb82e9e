"""Gateway overhead: the gateway with a fast in-process backend vs the same backend served alone.

    PYTHONPATH=. python bench/gateway.py [--requests 300] [--pairs 1000] [--concurrency 32]
                                         [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]

Both servers are uvicorn subprocesses on loopback, answered by the same `CannedBackend` (a
Backend that returns a fixed 8-token Generation at once), so the difference is what the gateway
adds: auth, routing, parsing, metrics and the durable commit of the completion row.

* added latency: sequential requests, p50/p99 of gateway minus p50/p99 of the bare backend server;
* logged events/s: `concurrency` editors each doing completion + feedback pairs (2 events per pair);
* store events/s: the log writer alone (group commit), no HTTP.

Prints a table and writes bench/out/gateway.json. Goals (issue 3): <= 1 ms p50 added, >= 2,000
logged events/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import FastBackend as CannedBackend  # noqa: E402  (a real Backend answering at once)
from bench.harness import bench_stores  # noqa: E402
from serving.store import Arm  # noqa: E402
from tasks.fim import build_prompt  # noqa: E402
from tasks.procs import free_port  # noqa: E402

PROMPT = build_prompt("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")


def serve(kind: str, db_url: str, port: int) -> None:
    """Subprocess entry: the gateway (auth on) or the bare backend server."""
    import uvicorn

    if kind == "bare":
        app = FastAPI()
        backend = CannedBackend(Arm("bare", "bare", "", "embedded", 1.0), 1.0)

        @app.post("/v1/completions")
        async def complete(request: Request):
            body = await request.json()
            gen = await backend.complete(body.get("prompt", ""), 8, 0.7, 1.0, [])
            return {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "choices": [{"text": gen.text, "index": 0, "finish_reason": "stop"}],
            }
    else:
        from serving.gateway import create_app
        from serving.store import init_schema, make_engine, replace_arms
        from tasks.config import load_params

        params = load_params(
            None,
            [
                f"paths.database_url={db_url}",
                "serving.rate_limit_per_minute=1000000",
                "serving.rate_limit_per_key_per_minute=1000000",
            ],
            environ={},
        )
        engine = make_engine(db_url)
        init_schema(engine)
        replace_arms(engine, [Arm("champion", "canned/1", "canned", "embedded", 1.0)])
        app = create_app(params, engine=engine, auth=True, backend_factory=CannedBackend)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _start(kind: str, db_url: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--db", db_url, "--port", str(port)], cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={}, timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def latency(url: str, n: int, headers: dict) -> list[float]:
    out = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for i in range(n + 20):
            t = time.perf_counter()
            r = client.post("/v1/completions", json={"prompt": PROMPT, "user": "bench"})
            elapsed = (time.perf_counter() - t) * 1000
            assert r.status_code == 200, r.text
            if i >= 20:  # warm-up
                out.append(elapsed)
    return out


async def _throughput(url: str, pairs: int, concurrency: int, headers: dict, bare: bool = False) -> float:
    """Requests/s of completion+feedback pairs (bare: two completions, the HTTP stack's ceiling here)."""
    counter = iter(range(pairs))

    async def editor(client: httpx.AsyncClient) -> int:
        events = 0
        for _ in counter:
            r = await client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.status_code == 200, r.text
            if bare:
                f = await client.post("/v1/completions", json={"prompt": PROMPT})
            else:
                f = await client.post("/v1/feedback", json={"completion_id": r.json()["id"], "accepted": True})
            assert f.status_code == 200, f.text
            events += 2
        return events

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
        start = time.perf_counter()
        events = sum(await asyncio.gather(*[editor(client) for _ in range(concurrency)]))
        return events / (time.perf_counter() - start)


async def _store_only(db_url: str, n: int, concurrency: int) -> float:
    from serving.log import LogWriter, insert_completion, prompt_hash
    from serving.store import init_schema, make_engine

    engine = make_engine(db_url)
    init_schema(engine)
    writer = LogWriter(engine, 256)
    writer.start()
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await writer.submit(
                insert_completion(
                    {
                        "id": f"store-{uuid.uuid4().hex}",
                        "created_at": time.time(),
                        "user_id": "bench",
                        "arm": "champion",
                        "model_version": "canned/1",
                        "prompt": PROMPT,
                        "prefix": "p",
                        "suffix": "s",
                        "completion": "return a + b",
                        "token_ids": [1] * 8,
                        "logprobs": [-0.1] * 8,
                        "temperature": 0.7,
                        "latency_ms": 1.0,
                        "abstained": False,
                        "prompt_hash": prompt_hash(PROMPT, "return a + b"),
                    }
                )
            )

    start = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n)])
    rate = n / (time.perf_counter() - start)
    writer.stop()
    engine.dispose()
    return rate


def _key(db_url: str) -> str:
    from serving.auth import add_key
    from serving.store import init_schema, make_engine

    engine = make_engine(db_url)
    init_schema(engine)
    key = add_key(engine, "bench")
    engine.dispose()
    return key


def run(args) -> dict:
    results = {}
    with bench_stores(args.postgres, "bench") as stores:
        port = free_port()
        bare = _start("bare", "", port)
        try:
            base = latency(f"http://127.0.0.1:{port}", args.requests, {})
            base_rate = asyncio.run(
                _throughput(f"http://127.0.0.1:{port}", args.pairs, args.concurrency, {}, bare=True)
            )
        finally:
            bare.terminate()
            bare.wait()
        results["bare"] = {"p50_ms": _pct(base, 50), "p99_ms": _pct(base, 99), "requests_per_s": base_rate}
        for name, db_url in stores.items():
            key = _key(db_url)
            headers = {"Authorization": f"Bearer {key}"}
            port = free_port()
            proc = _start("gateway", db_url, port)
            try:
                lat = latency(f"http://127.0.0.1:{port}", args.requests, headers)
                rate = asyncio.run(_throughput(f"http://127.0.0.1:{port}", args.pairs, args.concurrency, headers))
            finally:
                proc.terminate()
                proc.wait()
            store_rate = asyncio.run(_store_only(db_url, args.pairs * 2, args.concurrency * 2))
            results[name] = {
                "p50_ms": _pct(lat, 50),
                "p99_ms": _pct(lat, 99),
                "added_p50_ms": _pct(lat, 50) - results["bare"]["p50_ms"],
                "added_p99_ms": _pct(lat, 99) - results["bare"]["p99_ms"],
                "logged_events_per_s": rate,
                "store_events_per_s": store_rate,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests for the latency numbers")
    parser.add_argument("--pairs", type=int, default=1000, help="completion+feedback pairs for the throughput numbers")
    parser.add_argument("--concurrency", type=int, default=32, help="editors in flight at once")
    parser.add_argument(
        "--postgres", default=os.environ.get("TABRL_TEST_POSTGRES_URL"), help="also bench this PostgreSQL"
    )
    parser.add_argument("--serve", choices=["bare", "gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--db", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.db, args.port)
        return
    results = run(args)
    print(
        f"\nGateway overhead ({args.requests} sequential requests; {args.pairs} completion+feedback pairs "
        f"at concurrency {args.concurrency}; loopback, {os.cpu_count()} cores)"
    )
    print(
        f"{'server':<10}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}{'HTTP req/s':>12}"
        f"{'store ev/s':>12}"
    )
    for name, r in results.items():
        rate = r.get("logged_events_per_s", r.get("requests_per_s", 0))
        print(
            f"{name:<10}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r.get('added_p50_ms', 0):>11.2f}"
            f"{r.get('added_p99_ms', 0):>11.2f}{rate:>12.0f}{r.get('store_events_per_s', 0):>12.0f}"
        )
    print(
        "HTTP req/s: bare = completions/s of the bare server (the HTTP stack's ceiling on this machine); "
        "sqlite/postgres = logged events/s (completion + feedback) through the gateway"
    )
    out = ROOT / "bench" / "out" / "gateway.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items() if k not in ("serve", "db", "port", "postgres")},
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
