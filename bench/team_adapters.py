"""The cost of many teams' adapters on one base, in one run per backend (issue 57, item 6).

    make bench-tools                                   # wrk
    bash .ci/vllm-venv.sh .venv-vllm                   # vLLM's CPU build, for --backends vllm
    python -m bench.team_adapters --model models/smollm2-135m --counts 1 4 16 [--seconds 30] [--concurrency 8]

Per backend (`embedded`: the adapters in one PEFT model per base in the gateway process; `vllm`: one LoRA server for
the base), as the product runs it: the base is registered and served as the organisation's champion; then teams are
added one by one, each with its first version (a random rank-`train.lora_rank` adapter on all linear layers,
registered in its team's model, rolled out and promoted by `rollout()` and `promote()` inside a Prefect flow), until
1, 4, 16 teams (--counts) have an adapter of their own. At each count the gateway (`tabrl serve`, no auth) takes
typing-session requests from held-out regions spread round-robin over the teams (`X-Tabrl-Team`) for --seconds (wrk,
after a warm-up of up to 5 s that is not counted): requests/s, p50, p99, and resident memory (the gateway's process
tree, and the vLLM server's). The time for a new team's first version to go live: registered -> serving, the first
team's and the last one's. vLLM's server keeps `--max-loras serving.vllm_max_loras` adapters in a batch and
`--max-cpu-loras` loaded (sized from teams.sources: none here, so 4 by default); at 16 teams the adapters are past
those slots and vLLM loads one again from disk when a request needs it: the table shows what that costs. `--set
serving.vllm_max_loras=16` sizes the server for all of them.

Prints a table and writes bench/out/team_adapters.json. The load generator shares the cores with the servers:
compare within a backend.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from prefect import flow

from bench import CPU_OVERLAY
from bench.adapters import random_adapter, tree_rss, typing_bodies
from bench.loadgen import wrk_bodies
from flows.cli.console import console, print_table
from flows.online_loop import start_gateway
from tasks.core.config import Params, load_params
from tasks.core.procs import free_port
from tasks.core.store import open_store
from tasks.core.vllm import recorded_servers, stop_vllm
from tasks.deploy.arms import serve_champion
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.promote import promote
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.deploy.tracking import CycleRuns


@flow(name="bench-team-version")
def _go_live(version, params: Params, base_dir: str, team: str) -> float:
    """A team's version from registered to serving its team alone: rollout() as its challenger, then promote();
    the seconds inside the flow run."""
    started = time.perf_counter()
    rollout(version, str(resolve_model_dir(version.uri, params)), params, base_dir, team)
    with open_store(params.paths.database_url) as engine:
        promote(engine, params, team=team)
    return time.perf_counter() - started


def backend_sets(args, backend: str, state: Path) -> list[str]:
    sets = [
        f"model.base_dir={args.model.resolve()}",
        "train.adapter=lora",
        f"serving.backend={backend}",
        "serving.auth=false",
        "serving.config_ttl_s=0",
        f"paths.state_dir={state}",
        f"paths.database_url=sqlite:///{state}/tabrl.db",
        f"paths.mlflow_tracking_uri=sqlite:///{state}/mlflow.db",
        f"paths.models_dir={state}/models",
    ]
    if backend == "vllm":
        sets += [f"serving.vllm_python={args.vllm_python}", f"@{CPU_OVERLAY}"]
    limits = ["serving.rate_limit_per_minute=100000000", "serving.rate_limit_per_key_per_minute=100000000"]
    return [*sets, *limits, *args.set]


def run_backend(args, backend: str) -> dict:
    """The counts of one backend, adding teams as it goes; per count the load and memory, and go-live times."""
    state = Path(tempfile.mkdtemp(prefix=f"tabrl-bench-teams-{backend}-"))
    sets = backend_sets(args, backend, state)
    params = load_params(args.params, sets)
    os.environ["MLFLOW_TRACKING_URI"] = params.paths.mlflow_tracking_uri
    out: dict = {"counts": {}, "go_live_s": []}
    gateway = None
    try:
        serve_champion(params)  # the organisation's champion: the base, on vLLM its one LoRA server
        base = Registry(params).ensure_champion(params.model.base_dir)
        base_dir = str(resolve_model_dir(base.uri, params))
        adapter = random_adapter(Path(base_dir), state / "adapter", params)
        bodies = typing_bodies(params, 4000)
        teams: list[str] = []
        for count in sorted(args.counts):
            while len(teams) < count:
                team = f"team{len(teams):02d}"
                version = Registry(params, team).register(adapter, CycleRuns(params, team).start(), base=base)
                started = time.perf_counter()
                inside = _go_live(version, params, base_dir, team)
                out["go_live_s"].append({"team": team, "in_flow_s": inside, "total_s": time.perf_counter() - started})
                teams.append(team)
            if gateway is None:
                port = free_port()
                gateway = start_gateway(args.params, sets, port, state / "gateway.log")  # the real `tabrl serve`
            spread = [teams[i % len(teams)] for i in range(len(bodies))]
            url = f"http://127.0.0.1:{port}/v1/completions"
            wrk_bodies(url, bodies, {}, min(5.0, args.seconds / 3), args.concurrency, spread)  # warm-up, not counted:
            # each new team's adapter loads on its first requests (the go-live time has its probe, not this load)
            load = wrk_bodies(url, bodies, {}, args.seconds, args.concurrency, spread)
            out["counts"][count] = load.as_dict() | {"rss_mb": _rss_mb(gateway, params)}
            console.print(f"{backend}, {count} team adapter(s): {out['counts'][count]}", highlight=False)
    finally:
        stop_served(gateway, params)
    return out


def stop_served(gateway, params: Params) -> None:
    """Stop what a bench started to serve: its gateway process (None: not started) and the vLLM servers recorded in
    its state."""
    if gateway is not None:
        gateway.terminate()
        gateway.wait(timeout=60)
    for server in recorded_servers(params):
        stop_vllm(server.pid)


def _rss_mb(gateway, params: Params) -> dict[str, float]:
    """Resident memory: the gateway's process tree (the embedded adapters live there), and the vLLM server's."""
    rss = {"gateway": tree_rss(gateway.pid) / 2**20}
    for server in recorded_servers(params):
        rss["vllm"] = rss.get("vllm", 0.0) + tree_rss(server.pid) / 2**20
    return rss


def report(numbers: dict, args) -> None:
    from rich.table import Table

    table = Table(title=f"Team adapters on one base ({args.model.name}; wrk, {args.concurrency} connections)")
    for col in ("backend", "teams", "requests/s", "vs 1 team", "p50 ms", "p99 ms", "errors", "RSS MB"):
        table.add_column(col, justify="right")
    for backend, got in numbers["backends"].items():
        first = got["counts"][min(got["counts"])]["per_s"]
        for count, load in got["counts"].items():
            rss = " + ".join(f"{name} {mb:.0f}" for name, mb in load["rss_mb"].items())
            ratio = f"{load['per_s'] / first:.2f}x" if first else "-"
            cells = [f"{load['per_s']:.2f}", ratio, f"{load['p50_ms']:.0f}", f"{load['p99_ms']:.0f}"]
            table.add_row(backend, str(count), *cells, str(load["errors"]), rss)
        lives = got["go_live_s"]
        console.print(
            f"{backend}: a new team's first version, registered -> serving: first team {lives[0]['total_s']:.2f} s, "
            f"team {len(lives)} {lives[-1]['total_s']:.2f} s (inside the flow run: {lives[-1]['in_flow_s']:.2f} s)",
            highlight=False,
        )
    print_table(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(numbers, indent=2) + "\n")
    console.print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/tabrl-tiny"), help="the base checkpoint")
    parser.add_argument("--backends", nargs="+", default=["embedded", "vllm"], choices=["embedded", "vllm"])
    parser.add_argument("--counts", nargs="+", type=int, default=[1, 4, 16], help="teams with an adapter")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--seconds", type=float, default=30.0, help="wrk duration per count")
    parser.add_argument("--concurrency", type=int, default=8, help="wrk connections")
    parser.add_argument("--out", type=Path, default=Path("bench/out/team_adapters.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    numbers = {"model": str(args.model), "backends": {b: run_backend(args, b) for b in args.backends}}
    report(numbers, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
