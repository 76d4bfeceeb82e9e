"""`tabrl cycle` (a manual retraining run) and `tabrl schedule` (both flows as Prefect deployments)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tasks.config import DEFAULT_PARAMS_FILE
from tasks.console import ParamsOpt, SetOpt, console, params_or_exit


def cycle_cmd(
    force: Annotated[bool, typer.Option(help="Train even while a challenger is still under test.")] = False,
    repo: Annotated[Path, typer.Option(help="Project repo (DVC) the snapshot is versioned in.")] = Path("."),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Run one online RL cycle now: ingest -> reward -> train -> evaluate -> register -> rollout.

    Without PREFECT_API_URL this runs in Prefect's ephemeral mode; with a server, the run shows in its UI."""
    from flows.cycle import online_rl_cycle

    params_or_exit(params, set_)  # fail fast, with exit 2, on a bad config
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    report = online_rl_cycle(str(params), list(set_ or []), force=force, repo_dir=str(repo))
    console.print(f"cycle {report.status}: {report.reason}")
    if report.version:
        console.print(f"challenger: {report.version}  (MLflow run {report.run_id})")


def schedule_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Serve both flows as Prefect deployments against a Prefect server, on the schedules in params.

    Start a server first (`prefect server start --host 127.0.0.1`) and export
    PREFECT_API_URL=http://127.0.0.1:4200/api. Schedules do not fire in ephemeral mode. Trigger a
    manual run with `prefect deployment run 'online-rl-cycle/online-rl-cycle'`. Stop with Ctrl-C."""
    from datetime import timedelta

    from prefect import serve

    from flows.ab_decision import ab_decision
    from flows.cycle import online_rl_cycle

    p = params_or_exit(params, set_)
    if not os.environ.get("PREFECT_API_URL"):
        console.print(
            "error: PREFECT_API_URL is not set: schedules need a Prefect server "
            "(`prefect server start --host 127.0.0.1`, then export PREFECT_API_URL=http://127.0.0.1:4200/api)"
        )
        raise typer.Exit(2)
    args = {"params_file": str(params), "overrides": list(set_ or [])}
    timing = (
        {"cron": p.deploy.cycle_cron}
        if p.deploy.cycle_cron
        else {"interval": timedelta(minutes=p.deploy.cycle_every_minutes)}
    )
    cycle = online_rl_cycle.to_deployment(name="online-rl-cycle", parameters=args, **timing)
    decision = ab_decision.to_deployment(
        name="ab-decision", parameters=args, interval=timedelta(minutes=p.deploy.decision_every_minutes)
    )
    console.print(
        f"serving deployments: online-rl-cycle ({timing}), ab-decision (every {p.deploy.decision_every_minutes} min)"
    )
    serve(cycle, decision)
