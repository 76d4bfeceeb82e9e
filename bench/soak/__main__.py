"""`python -m bench.soak`: see the package's docstring (bench/soak/__init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import sqlalchemy as sa

import bench.soak
from bench.soak.faults import fault_plan, run_faults, run_samples, run_worker_fault
from bench.soak.reconcile import MUST_BE_ZERO, reconcile_cycles, reconcile_snapshots, reconcile_store
from bench.soak.report import machine, plot, print_report
from bench.soak.stack import ROOT, Soak, bring_up, stop_stack
from bench.soak.traffic import Ledger, traffic
from flows.cli.console import console
from tasks.core.config import load_params
from tests.support.harness import throwaway_schema


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=bench.soak.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--hours", type=float, help="length of the traffic (the recorded run: 2)")
    length.add_argument("--minutes", type=float, help="length of the traffic, for a short soak (CI: 10)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "soak", help="results (emptied first)")
    parser.add_argument("--cycle-every", type=float, default=None, help="minutes between scheduled cycles")
    parser.add_argument("--decide-every", type=float, default=2.0, help="minutes between scheduled A/B decisions")
    parser.add_argument("--peak-rps", type=float, default=8.0, help="requests/s at the day's peak")
    parser.add_argument("--min-rps", type=float, default=1.5, help="requests/s at night")
    parser.add_argument("--rounds-of-faults", type=int, default=None, help="times each fault is injected")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("TABRL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
        help="a PostgreSQL database the log store gets a throwaway schema in",
    )
    parser.add_argument(
        "--pg-restart",
        default=None,
        help="command that restarts that PostgreSQL (default: pg_ctlcluster's restart of the one cluster in "
        "/etc/postgresql)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seconds = (args.minutes if args.minutes is not None else args.hours * 60) * 60
    rounds = args.rounds_of_faults or (1 if args.minutes is not None else 2)
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ledger = Ledger(out / "ledger.jsonl")
    with throwaway_schema(args.postgres_url) as db_url:
        soak = bring_up(args, out, db_url)
        engine = sa.create_engine(db_url, pool_pre_ping=True)
        stop = threading.Event()
        plan = fault_plan(seconds, rounds, args.seed)
        cycle_s = load_params(soak.params_file, []).deploy.cycle_every_minutes * 60  # a training to kill comes by then
        faults = [
            threading.Thread(target=run_faults, args=(soak, ledger, plan, stop), daemon=True),
            threading.Thread(target=run_worker_fault, args=(soak, plan, seconds + cycle_s, stop), daemon=True),
        ]
        sampler = threading.Thread(target=run_samples, args=(soak, engine, stop), daemon=True)
        try:
            for thread in (*faults, sampler):
                thread.start()
            n_rounds = asyncio.run(traffic(soak, ledger, seconds, args, stop))
            soak.event("traffic ended", rounds=n_rounds)
            for thread in faults:
                thread.join()  # the last fault's recovery
            settle(soak)
            stop.set()
            sampler.join()
            table = reconcile_store(engine, ledger)
            table |= reconcile_snapshots(engine, soak.repo, load_params(soak.params_file, []).paths.data_dir)
            cycles, detail = reconcile_cycles(soak)
            table |= cycles
        finally:
            stop.set()
            left = stop_stack(soak)
            soak.redis.kill()
            engine.dispose()
            ledger.close()
    table["processes left after stop"] = len(left)
    table["failed requests (all kinds)"] = sum(ledger.failures.values())
    faults = [e for e in soak.events if e["kind"] == "fault"]
    table["faults injected"] = sum(1 for f in faults if f.get("injected", True))
    table["faults not injected"] = sum(1 for f in faults if not f.get("injected", True))
    table["faults not recovered from"] = sum(1 for f in faults if f.get("injected", True) and f["recovery_s"] is None)
    return finish(out, soak, ledger, table, detail, left, seconds, argv)


def finish(out: Path, soak: Soak, ledger: Ledger, table: dict, detail: dict, left: list, seconds: float, argv):
    """Write soak.json and soak.png, print the tables; 1 when a count that must be 0 is not."""
    problems = [k for k in MUST_BE_ZERO if table.get(k)]
    report = {
        "command": " ".join(["python -m bench.soak", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(soak.params_file),
        "seconds": seconds,
        "table": table,
        "failures": ledger.failures,
        "faults": [e for e in soak.events if e["kind"] == "fault"],
        "events": soak.events,
        "samples": soak.samples,
        **detail,  # the cycle runs, the aliases, the arms
        "left_after_stop": left,
        "problems": problems,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(out / "soak.png", soak, ledger, bin_s=max(60.0, seconds / 40))
    print_report(report, soak)
    if problems:
        console.print(f"SOAK FAILED: {', '.join(f'{k} = {table[k]}' for k in problems)}", highlight=False)
        return 1
    console.print(f"soak passed: every count that must be 0 is 0 ({out / 'soak.json'}, {out / 'soak.png'})")
    return 0


def settle(soak: Soak, timeout_s: float = 900.0) -> None:
    """Pause the deployments' schedules (no run starts during the reconciliation), then wait for the running
    flow runs (if any) to end, so the reconciliation sees a stack at rest."""
    for deployment in httpx.post(f"{soak.prefect_api}/deployments/filter", json={}, timeout=30).json():
        url = f"{soak.prefect_api}/deployments/{deployment['id']}"
        httpx.patch(url, json={"paused": True}, timeout=30).raise_for_status()
    soak.event("schedules paused")
    flt = {"flow_runs": {"state": {"type": {"any_": ["RUNNING", "PENDING", "CANCELLING"]}}}}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if not httpx.post(f"{soak.prefect_api}/flow_runs/filter", json=flt, timeout=10).json():
                return
        time.sleep(5.0)


if __name__ == "__main__":
    sys.exit(main())
