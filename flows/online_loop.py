"""The whole online loop on one machine: gateway, simulated editors, RL cycles, A/B decisions.

    python -m flows.online_loop --cycles 3 --requests 240       # what `make demo` runs

Order of work, each cycle:
  1. simulated users (train-split FIM samples) use the gateway over HTTP: request, Tab or silence;
  2. wait out the feedback timeout, so every shown suggestion has an outcome;
  3. if a challenger is live: the A/B decision flow promotes it, rolls it back, or keeps collecting;
  4. online_rl_cycle: ingest -> reward -> train -> evaluate (held-out test files) -> register -> rollout.
At the end: a per-cycle table, a plot of the curves (saved, and logged to MLflow), and how to open
the MLflow and Prefect UIs on the results. State lives under --state (fresh each run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flows.ab_decision import ab_decision
from flows.cycle import online_rl_cycle
from serving.simulate import run_simulation
from serving.simulator import make_users, merge
from serving.store import Arm, init_schema, make_engine, replace_arms
from tasks.config import DEFAULT_PARAMS_FILE, Params, load_params
from tasks.deploy.registry import CHAMPION, ensure_champion, resolve_model_dir
from tasks.ingest.corpus import read_samples
from tasks.procs import NotUp, free_port, wait_until_up
from tasks.reward.reward import reward_per_request

DEMO_OVERRIDES = [
    "serving.auth=false",  # the local demo only: simulated users are identified by the `user` field
]


@dataclass
class CycleRow:
    cycle: int
    arms_served: str  # arm=version pairs that served this cycle's traffic
    requests: int
    suggest_rate: float  # online, all arms
    accept_rate: float  # online, per shown suggestion
    reward_per_request: float  # online
    decision: str  # A/B decision taken after the traffic (or "-")
    cycle_status: str  # deployed | gate_failed | skipped
    eval_judge_mean: float | None  # held-out, the cycle's candidate
    eval_accept_rate: float | None
    eval_reward_per_request: float | None
    champion_eval_reward_per_request: float | None
    serving_eval: dict  # held-out metrics of the model serving after this cycle (empty when not evaluated)


def start_gateway(params_file: str, overrides: list[str], port: int, log_path: Path) -> subprocess.Popen:
    """`tabrl serve` in its own process (as in production), returning once /healthz answers."""
    sets = [x for o in overrides for x in ("--set", o)]
    cmd = [sys.executable, "-m", "tasks", "serve", "--no-auth", "--port", str(port), "--params", params_file, *sets]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/healthz", proc, 180)
    except NotUp as err:
        proc.terminate()
        raise RuntimeError(f"gateway: {err}; see {log_path}") from err
    return proc


def run_online_loop(params_file: str, overrides: list[str], cycles: int, requests: int, n_users: int,
                    state: Path, seed: int = 0, ab_test: bool = True) -> list[CycleRow]:
    """Run `cycles` online cycles from a fresh state dir; returns one row per cycle.

    ab_test=True: a deployed candidate serves as challenger and the A/B decision flow decides (the
    product). ab_test=False: every deployed candidate is promoted at once (trust the gate), so each
    cycle's traffic comes from the newest model: what the learning benchmark measures."""
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    overrides = [*DEMO_OVERRIDES, f"paths.state_dir={state}", f"paths.database_url=sqlite:///{state}/tabrl.db",
                 f"paths.mlflow_tracking_uri=sqlite:///{state}/mlflow.db", f"paths.models_dir={state}/models",
                 f"simulator.seed={seed}", f"train.seed={seed}", f"serving.seed={seed}", *overrides]
    params = load_params(params_file, overrides)
    os.environ["MLFLOW_TRACKING_URI"] = params.paths.mlflow_tracking_uri

    champion = ensure_champion(params.model.base_dir, params)  # the base model is version 1, `champion`
    engine = make_engine(params.paths.database_url)
    init_schema(engine)
    replace_arms(engine, [Arm(CHAMPION, champion.label, str(resolve_model_dir(champion.uri, params)), "embedded", 1.0)])
    engine.dispose()

    repo = _snapshot_repo(state / "repo")  # every interaction snapshot is versioned here with DVC
    traffic = read_samples(Path(params.paths.data_dir) / "fim" / "train.parquet")  # never the held-out files
    users = make_users(n_users, params.simulator, prefix=f"sim{seed}")
    port = free_port()
    gateway = start_gateway(params_file, overrides, port, state / "gateway.log")
    rows: list[CycleRow] = []
    try:
        for cycle in range(1, cycles + 1):
            offset = (cycle - 1) * requests
            window = [traffic[(offset + i) % len(traffic)] for i in range(requests)]
            by_arm = run_simulation(f"http://127.0.0.1:{port}", window, users, requests, api_keys=None,
                                    concurrency=4, seed=seed * 1000 + cycle)
            time.sleep(params.ingest.feedback_timeout_s + 0.5)
            decision = ab_decision(params_file, overrides) if ab_test and len(by_arm) > 1 else None
            report = online_rl_cycle(params_file, overrides, repo_dir=str(repo))
            if not ab_test and report.status == "deployed":
                _promote_now(params)
            total = merge(list(by_arm.values()))
            m = report.metrics
            rows.append(CycleRow(
                cycle=cycle,
                arms_served=", ".join(f"{arm}:{s.requests}" for arm, s in sorted(by_arm.items())),
                requests=total.requests, suggest_rate=total.suggest_rate, accept_rate=total.accept_rate,
                reward_per_request=reward_per_request(total, params.reward),
                decision=decision.action if decision else "-",
                cycle_status=report.status,
                eval_judge_mean=m.get("eval/judge_mean"), eval_accept_rate=m.get("eval/accept_rate"),
                eval_reward_per_request=m.get("eval/reward_per_request"),
                champion_eval_reward_per_request=m.get("eval/champion/reward_per_request"),
                serving_eval=_serving_eval(report, promoted=not ab_test),
            ))
            print(json.dumps(asdict(rows[-1])), flush=True)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    return rows


def _serving_eval(report, promoted: bool) -> dict:
    """Held-out metrics of whoever serves next: the promoted candidate, else the champion."""
    m = report.metrics
    if promoted and report.status == "deployed":
        return {k: v for k, v in m.items() if k.startswith("eval/") and not k.startswith("eval/champion/")}
    return {k.replace("eval/champion/", "eval/", 1): v for k, v in m.items() if k.startswith("eval/champion/")}


def _snapshot_repo(path: Path) -> Path:
    """A git + DVC repo of its own for the loop's snapshots (the project's git history is left alone)."""
    path.mkdir(parents=True)
    for cmd in (["git", "init", "-q"], ["git", "config", "user.name", "tabrl"], ["git", "config", "user.email", "tabrl@localhost"],
                [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                ["git", "commit", "-qm", "tabrl interaction snapshots"]):
        subprocess.run(cmd, cwd=path, check=True)
    return path


def _promote_now(params: Params) -> None:
    from tasks.deploy.promote import promote

    engine = make_engine(params.paths.database_url)
    try:
        promote(engine, params)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default=str(DEFAULT_PARAMS_FILE), help="params.yaml to read")
    parser.add_argument("--set", action="append", default=[], help="override one key: section.key=value")
    parser.add_argument("--cycles", type=int, default=3, help="online RL cycles to run")
    parser.add_argument("--requests", type=int, default=240, help="simulated completion requests per cycle")
    parser.add_argument("--users", type=int, default=24, help="simulated users")
    parser.add_argument("--state", type=Path, default=Path("state/demo"), help="state dir (wiped at start)")
    args = parser.parse_args(argv)
    # Prefect's ephemeral server gets 20 s to start by default; a busy 2-core laptop can need more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    rows = run_online_loop(args.params, args.set, args.cycles, args.requests, args.users, args.state)
    print_report(rows, args.state, load_params(args.params, [f"paths.mlflow_tracking_uri=sqlite:///{args.state}/mlflow.db"]))
    return 0


def print_report(rows: list[CycleRow], state: Path, params: Params) -> None:
    from rich.console import Console
    from rich.table import Table

    from flows.plots import plot_cycles

    table = Table(title="tabrl online RL cycles (online = simulated users over HTTP; eval = held-out test files)")
    for col in ("cycle", "arms (requests)", "online suggest", "online accept/shown", "online reward/req",
                "A/B decision", "cycle", "eval judge", "eval accept/shown", "eval reward/req (champion)"):
        table.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        table.add_row(str(r.cycle), r.arms_served, fmt(r.suggest_rate), fmt(r.accept_rate), fmt(r.reward_per_request),
                      r.decision, r.cycle_status, fmt(r.eval_judge_mean), fmt(r.eval_accept_rate),
                      f"{fmt(r.eval_reward_per_request)} ({fmt(r.champion_eval_reward_per_request)})")
    console = Console(width=160)
    console.print(table)
    plot = plot_cycles(rows, state / "cycles.png", params.paths.mlflow_tracking_uri)
    (state / "cycles.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    console.print(f"Plot: {plot}   Table: {state / 'cycles.json'}")
    console.print(f"MLflow UI:  mlflow ui --backend-store-uri {params.paths.mlflow_tracking_uri} --workers 1  "
                  "(then http://127.0.0.1:5000)")
    console.print("Prefect UI: prefect server start --host 127.0.0.1, then `tabrl schedule` (http://127.0.0.1:4200); "
                  "this run used Prefect's ephemeral mode")


if __name__ == "__main__":
    sys.exit(main())
