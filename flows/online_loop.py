"""The whole online loop on one machine: gateway, simulated editors, RL cycles, A/B decisions.

    python -m flows.online_loop --cycles 3 --requests 240       # what `make demo` runs

Order of work, each cycle:
  1. simulated users type regions of train-split files through the gateway over HTTP (editor
     traffic, tasks/sim/editor.py): a request at every pause, Tab or type on;
  2. wait out the feedback timeout, so every shown suggestion has an outcome;
  3. if a challenger is live: the A/B decision flow promotes it, rolls it back, or keeps collecting;
  4. online_rl_cycle: ingest -> reward -> train -> evaluate (held-out test files) -> register -> rollout.
At the end: a per-cycle table, a plot of the curves (saved, and logged to MLflow), and how to open
the MLflow and Prefect UIs on the results. State lives under --state (fresh each run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from flows.ab_decision import ab_decision
from flows.cycle import online_rl_cycle
from flows.loop_state import CycleRow, LoopMismatch, restore_checkpoint, save_checkpoint
from flows.report import print_report, print_story, print_ui_pointers
from serving.simulate import run_simulation
from tasks.core.config import DEFAULT_PARAMS_FILE, Params, load_params
from tasks.core.outcomes import reward_per_request
from tasks.core.procs import NotUp, exit_on_sigterm, free_port, wait_until_up
from tasks.core.store import CHAMPION, open_store
from tasks.core.teams import ORG
from tasks.core.vllm import recorded_servers, restart_recorded, stop_vllm_at
from tasks.deploy.arms import serve_champion, sync_adapters
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.ingest.versioning import ensure_repo
from tasks.sim.editor import read_regions, regions_path
from tasks.sim.sessions import merge_typing
from tasks.sim.users import make_users

DEMO_OVERRIDES = [
    "serving.auth=false",  # the local demo only: simulated users are identified by the `user` field
]


def start_gateway(
    params_file: str, overrides: list[str], port: int, log_path: Path, auth: bool = False
) -> subprocess.Popen:
    """`tabrl serve` in its own process (as in production), returning once /healthz answers; without auth (the demo's
    users are named by the `user` field) unless `auth`."""
    sets = [x for o in overrides for x in ("--set", o)]
    cmd = [sys.executable, "-m", "flows.cli", "serve", *([] if auth else ["--no-auth"]), "--port", str(port)]
    cmd += ["--params", params_file, *sets]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    with contextlib.ExitStack() as stopped_unless_up:  # a failure or a SIGTERM while waiting stops it too
        stopped_unless_up.callback(proc.terminate)
        try:
            wait_until_up(f"http://127.0.0.1:{port}/healthz", proc, 180)
        except NotUp as err:
            raise RuntimeError(f"gateway: {err}; see {log_path}") from err
        stopped_unless_up.pop_all()
    return proc


def _start_state(params: Params, state: Path, restored: dict | None, cycles: int) -> list[CycleRow]:
    """A fresh state dir (the champion served, the snapshot repo made), or the restored loop's servers and adapters
    back; returns the rows of the cycles already done."""
    if restored is None:
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True)
        serve_champion(params)  # the base model is version 1, `champion`, the one arm (on vLLM: its base's server)
        snapshot_repo(state / "repo")  # every interaction snapshot is versioned here with DVC
        return []
    rows = [CycleRow(**row) for row in restored["rows"]]
    print(f"resumed {state} after cycle {restored['cycle']} of {cycles}", flush=True)
    restart_recorded(params)  # the vLLM servers the arms name, on their ports; then their adapters
    sync_adapters(params)
    return rows


def cycle_regions(n_users: int, requests: int) -> int:
    """Train regions offered to one cycle's users (cycle k gets the k-th such stretch): more than they will type."""
    return max(n_users, requests // 4)


def simulate_cycle(
    port: int,
    traffic: list,
    per_cycle: int,
    cycle: int,
    users: list,
    requests: int,
    seed: int,
    params: Params,
    api_keys: dict[str, str] | None = None,
):
    """One cycle's traffic: the users type this cycle's window of regions through the gateway on `port` (with
    their API keys when given)."""
    offset = (cycle - 1) * per_cycle
    window = [traffic[(offset + i) % len(traffic)] for i in range(per_cycle)]
    return run_simulation(
        f"http://127.0.0.1:{port}",
        window,
        users,
        requests,
        api_keys=api_keys,
        concurrency=4,
        seed=seed * 1000 + cycle,
        traffic=params.traffic,
        simulator=params.simulator,
    )


def run_online_loop(
    params_file: str,
    overrides: list[str],
    cycles: int,
    requests: int,
    n_users: int,
    state: Path,
    seed: int = 0,
    ab_test: bool = True,
    resume: bool = False,
    after_cycle: Callable[[list[CycleRow]], int] | None = None,
) -> tuple[list[CycleRow], Params]:
    """Run `cycles` online cycles in the state dir; returns one row per cycle and the loop's params (its state
    paths: ``champion_dir(params)`` is the model serving at the end).

    ab_test=True: a deployed candidate serves as challenger and the A/B decision flow decides (the
    product). ab_test=False: every deployed candidate is promoted at once (trust the gate), so each
    cycle's traffic comes from the newest model: what the learning benchmark measures.
    resume=True: a loop of the same params and size that was stopped goes on after its last finished cycle
    (`flows/loop_state.py`); otherwise, and without a checkpoint, the state dir starts fresh.
    after_cycle: called with the rows after each cycle; it returns how many cycles to run in all (the demo plans
    the rest from the first cycle's pace)."""
    overrides = loop_overrides(overrides, state, seed)
    params = load_params(params_file, overrides)
    identity = loop_identity(params, requests, n_users, seed, ab_test)
    restored = restore_checkpoint(state, identity, cycles) if resume and state.is_dir() else None
    os.environ["MLFLOW_TRACKING_URI"] = params.paths.mlflow_tracking_uri
    rows = _start_state(params, state, restored, cycles)
    repo = state / "repo"
    traffic = read_regions(regions_path(params.paths.data_dir, "train"))  # never the held-out files
    per_cycle = cycle_regions(n_users, requests)
    users = make_users(n_users, params.simulator, prefix=f"sim{seed}")
    port = free_port()
    gateway = start_gateway(params_file, overrides, port, state / "gateway.log")
    try:
        while len(rows) < cycles:
            cycle = len(rows) + 1
            started = time.perf_counter()
            by_arm = simulate_cycle(port, traffic, per_cycle, cycle, users, requests, seed, params)
            traffic_s = time.perf_counter() - started
            time.sleep(params.ingest.feedback_timeout_s + 0.5)
            decision = ab_decision(params_file, overrides, ORG)[ORG] if ab_test and len(by_arm) > 1 else None
            started = time.perf_counter()
            report = online_rl_cycle(params_file, overrides, repo_dir=str(repo))
            if not ab_test and report.status == "deployed":
                _promote_now(params)
            rows.append(
                _row(cycle, by_arm, decision, report, params, ab_test, traffic_s, time.perf_counter() - started)
            )
            print(json.dumps(asdict(rows[-1])), flush=True)
            save_checkpoint(state, identity, cycle, [asdict(r) for r in rows])
            cycles = cycles if after_cycle is None else after_cycle(rows)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        for server in recorded_servers(params):  # the vLLM servers this loop started (its state dir records them)
            stop_vllm_at(server.url, params)
    return rows, params


def _row(cycle, by_arm, decision, report, params: Params, ab_test: bool, traffic_s: float, cycle_s: float) -> CycleRow:
    total = merge_typing(list(by_arm.values()))
    m = report.metrics
    return CycleRow(
        cycle=cycle,
        arms_served=", ".join(f"{arm}:{s.requests}" for arm, s in sorted(by_arm.items())),
        requests=total.requests,
        suggest_rate=total.suggest_rate,
        accept_rate=total.accept_rate,
        right_rate=total.right_rate,
        chars_saved=total.chars_saved,
        reward_per_request=reward_per_request(total, params.reward),
        decision=decision.action if decision else "-",
        cycle_status=report.status,
        eval_judge_mean=m.get("eval/judge_mean"),
        eval_accept_rate=m.get("eval/typing/accept_rate"),
        eval_chars_saved=m.get("eval/typing/chars_saved"),
        eval_reward_per_request=m.get("eval/typing/reward_per_request"),
        champion_eval_reward_per_request=m.get("eval/champion/typing/reward_per_request"),
        serving_eval=_serving_eval(report, promoted=not ab_test),
        traffic_s=traffic_s,
        train_s=m.get("time/train_s", 0.0),
        evaluate_s=m.get("time/evaluate_s", 0.0),
        cycle_s=cycle_s,
        typing_s=m.get("time/typing_s", 0.0),
    )


def loop_identity(params: Params, requests: int, n_users: int, seed: int, ab_test: bool) -> dict:
    """What a loop's checkpoint is valid for: its resolved params (but where its files go) and its size. Not the
    number of cycles: a resumed loop may be asked for more."""
    body = params.model_dump(mode="json")
    body.pop("paths")
    body["loop"] = {"requests": requests, "users": n_users, "seed": seed, "ab_test": ab_test}
    return body


def loop_overrides(overrides: list[str], state: Path, seed: int) -> list[str]:
    """The overrides of an online loop whose store, registry and models live in `state`: with them,
    ``champion_dir(load_params(params_file, ...))`` finds the model a finished loop ended with."""
    return [
        *DEMO_OVERRIDES,
        f"paths.state_dir={state}",
        f"paths.database_url=sqlite:///{state}/tabrl.db",
        f"paths.mlflow_tracking_uri=sqlite:///{state}/mlflow.db",
        f"paths.models_dir={state}/models",
        f"simulator.seed={seed}",
        f"train.seed={seed}",
        f"serving.seed={seed}",
        *overrides,
    ]


def champion_dir(params: Params) -> Path:
    """The checkpoint the champion alias points at now."""
    return resolve_model_dir(Registry(params).aliased(CHAMPION).uri, params)


def _serving_eval(report, promoted: bool) -> dict:
    """Held-out metrics of whoever serves next: the promoted candidate, else the champion."""
    m = report.metrics
    if promoted and report.status == "deployed":
        return {k: v for k, v in m.items() if k.startswith("eval/") and not k.startswith("eval/champion/")}
    return {k.replace("eval/champion/", "eval/", 1): v for k, v in m.items() if k.startswith("eval/champion/")}


def snapshot_repo(path: Path) -> Path:
    """A git + DVC repo of its own for the loop's snapshots (the project's git history is left alone)."""
    if path.exists():
        raise FileExistsError(f"{path} exists: a loop's snapshot repo starts empty")
    return ensure_repo(path)


def _promote_now(params: Params) -> None:
    from tasks.deploy.promote import promote

    with open_store(params.paths.database_url) as engine:
        promote(engine, params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default=str(DEFAULT_PARAMS_FILE), help="params.yaml to read")
    parser.add_argument("--set", action="append", default=[], help="override one key: section.key=value")
    parser.add_argument("--cycles", type=int, default=3, help="online RL cycles to run")
    parser.add_argument("--requests", type=int, default=240, help="simulated completion requests per cycle")
    parser.add_argument("--users", type=int, default=24, help="simulated users")
    parser.add_argument("--state", type=Path, default=Path("state/demo"), help="state dir (wiped, unless --resume)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on after the last finished cycle of a stopped loop with the same params and size (same --state), "
        "up to --cycles (a finished loop can be given more); another loop's state is refused, not wiped",
    )
    args = parser.parse_args(argv)
    exit_on_sigterm()  # a `kill` stops the gateway this loop started, too
    # Prefect's ephemeral server gets 20 s to start by default; a busy 2-core laptop can need more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    try:
        rows, params = run_online_loop(
            args.params, args.set, args.cycles, args.requests, args.users, args.state, resume=args.resume
        )
    except LoopMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_report(rows, args.state, params)
    print_story(Path(params.model.base_dir), champion_dir(params), args.state, params)
    print_ui_pointers(params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
