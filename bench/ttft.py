"""Time to the first token, streamed vs unstreamed, in one run (issue 58, item 1).

    make data                                           # the held-out typing regions the requests come from
    python -m bench.ttft [--model models/tabrl-tiny] [--requests 60] [--max-tokens 48] [--backend embedded]

The real gateway (`tabrl serve`, no auth, the model as the one arm) answers typing-session requests over held-out
regions (the editors' pauses, as bench.team_adapters sends them), each request twice, back to back: once with
`stream: true`, once without, in alternating order so neither side always goes first. Measured per request, from
the request's send:

- unstreamed: the whole answer (its first byte is its last: the text comes when generation ends);
- streamed: the first chunk that carries text (what an editor that renders a stream could show), and the last.

One client, one request at a time: the latency of one request, not the server's capacity (a load generator such as
wrk cannot see a stream's first chunk). Only pairs whose suggestion is not empty count for the time to text (an empty
one has no text to stream). Prints a table and writes bench/out/ttft.json; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.adapters import typing_bodies
from bench.gateway import machine
from bench.team_adapters import backend_sets, stop_served
from flows.cli.console import console
from flows.online_loop import start_gateway
from tasks.core.config import load_params
from tasks.core.procs import free_port
from tasks.deploy.arms import serve_champion


def _unstreamed(client: httpx.Client, url: str, body: dict) -> dict:
    started = time.perf_counter()
    answer = client.post(url, json=body)
    answer.raise_for_status()
    return {"total_s": time.perf_counter() - started, "text": answer.json()["choices"][0]["text"]}


def _streamed(client: httpx.Client, url: str, body: dict) -> dict:
    started, first_text, text = time.perf_counter(), None, ""
    with client.stream("POST", url, json={**body, "stream": True}) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            piece = chunk["choices"][0]["text"] if chunk["choices"] else ""
            if piece and first_text is None:
                first_text = time.perf_counter() - started
            text += piece
    return {"total_s": time.perf_counter() - started, "first_text_s": first_text, "text": text}


def measure(url: str, bodies: list[str], max_tokens: int) -> list[dict]:
    pairs = []
    with httpx.Client(timeout=600) as client:
        for i, raw in enumerate(bodies):
            body = {**json.loads(raw), "max_tokens": max_tokens, "temperature": 0}  # both sides make the same tokens
            if i % 2:
                plain, streamed = _unstreamed(client, url, body), _streamed(client, url, body)
            else:
                streamed, plain = _streamed(client, url, body), _unstreamed(client, url, body)
            pairs.append({"unstreamed": plain, "streamed": streamed})
            console.print(f"\r{i + 1}/{len(bodies)} pairs", end="", highlight=False)
    console.print()
    return pairs


def summary(pairs: list[dict]) -> dict:
    shown = [p for p in pairs if p["streamed"]["first_text_s"] is not None and p["unstreamed"]["text"]]

    def ms(values: list[float]) -> dict:
        if not values:
            return {"p50_ms": None, "p90_ms": None}
        q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        return {"p50_ms": 1000 * statistics.median(values), "p90_ms": 1000 * q[8]}

    ratios = [p["streamed"]["first_text_s"] / p["unstreamed"]["total_s"] for p in shown]
    return {
        "pairs": len(pairs),
        "pairs_with_text": len(shown),
        "unstreamed_answer": ms([p["unstreamed"]["total_s"] for p in shown]),
        "streamed_first_text": ms([p["streamed"]["first_text_s"] for p in shown]),
        "streamed_last_chunk": ms([p["streamed"]["total_s"] for p in shown]),
        "median_ratio_first_text_vs_unstreamed": statistics.median(ratios) if ratios else None,
        "same_text": sum(p["streamed"]["text"] == p["unstreamed"]["text"] for p in pairs),
    }


def report(out: dict, path: Path) -> None:
    from rich.table import Table

    from flows.cli.console import print_table

    s = out["summary"]
    table = Table(title=f"Time to text, {out['model']} on {out['backend']} ({s['pairs_with_text']} pairs with text)")
    for col in ("", "p50 ms", "p90 ms"):
        table.add_column(col, justify="right")
    for label, key in [
        ("unstreamed: whole answer", "unstreamed_answer"),
        ("streamed: first text", "streamed_first_text"),
        ("streamed: last chunk", "streamed_last_chunk"),
    ]:
        table.add_row(label, *(f"{s[key][q]:.0f}" if s[key][q] is not None else "-" for q in ("p50_ms", "p90_ms")))
    print_table(table)
    ratio = s["median_ratio_first_text_vs_unstreamed"]
    console.print(
        f"median of the pairs' ratios, streamed first text / unstreamed answer: "
        f"{'-' if ratio is None else f'{ratio:.2f}'}; identical text in {s['same_text']} of {s['pairs']} pairs",
        highlight=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/tabrl-tiny"), help="the base checkpoint")
    parser.add_argument("--backend", default="embedded", choices=["embedded", "vllm"])
    parser.add_argument("--requests", type=int, default=60, help="pairs of requests")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="for --backend vllm")
    parser.add_argument("--out", type=Path, default=Path("bench/out/ttft.json"))
    args = parser.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="tabrl-bench-ttft-"))
    sets = backend_sets(args, args.backend, state)  # the model as the one arm, its state, no rate limits
    params = load_params(args.params, sets)
    os.environ["MLFLOW_TRACKING_URI"] = params.paths.mlflow_tracking_uri
    before = machine()
    gateway = None
    try:
        serve_champion(params)  # on vLLM: the model's server, stopped at the end
        port = free_port()
        gateway = start_gateway(args.params, sets, port, state / "gateway.log")
        url = f"http://127.0.0.1:{port}/v1/completions"
        pairs = measure(url, typing_bodies(params, args.requests), args.max_tokens)
    finally:
        stop_served(gateway, params)
    out = {"model": str(args.model), "backend": args.backend, "machine": before, "summary": summary(pairs)}
    report(out | {"pairs": pairs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
