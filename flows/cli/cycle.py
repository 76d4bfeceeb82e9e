"""`tabrl cycle` (a manual retraining run), `tabrl schedule` (both flows served from one process: a laptop)
and `tabrl deploy` (the flows as deployments on Prefect work pools: a cluster)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.console import ParamsOpt, SetOpt, console, fail, params_or_exit
from tasks.core.config import DEFAULT_PARAMS_FILE, Params
from tasks.core.teams import ORG, check_team


def cycle_schedules(p: Params) -> list:
    """online-rl-cycle's schedules: the organisation's, and one per team with a code base (teams.sources) with
    the `team` parameter; deploy.cycle_cron, else every deploy.cycle_every_minutes. Each team's cycle holds its own
    slot, so they run side by side."""
    from datetime import timedelta

    from prefect.schedules import Cron, Interval

    def every(team: str):
        parameters = {} if team == ORG else {"team": team}
        if p.deploy.cycle_cron:
            return Cron(p.deploy.cycle_cron, parameters=parameters)
        return Interval(timedelta(minutes=p.deploy.cycle_every_minutes), parameters=parameters)

    return [every(team) for team in (ORG, *sorted(p.teams.sources))]


TeamOpt = Annotated[str, typer.Option(help="The team whose cycle it is (`org`: the organisation's model).")]


def cycle_cmd(
    force: Annotated[bool, typer.Option(help="Train even while a challenger is still under test.")] = False,
    repo: Annotated[
        Path | None,
        typer.Option(help="The git + DVC repo the snapshot is versioned in (default: paths.snapshots_repo)."),
    ] = None,
    team: TeamOpt = ORG,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Run one online RL cycle now: ingest -> reward -> train -> evaluate -> register -> rollout.

    Without PREFECT_API_URL this runs in Prefect's ephemeral mode; with a server, the run shows in its UI."""
    from flows.cycle import online_rl_cycle

    params_or_exit(params, set_)  # fail fast, with exit 2, on a bad config
    try:
        check_team(team)
    except ValueError as err:
        fail(f"--team: {err}", 2)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    report = online_rl_cycle(str(params), list(set_ or []), force=force, repo_dir=repo and str(repo), team=team)
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
    schedules = cycle_schedules(p)
    cycle = online_rl_cycle.to_deployment(name="online-rl-cycle", parameters=args, schedules=schedules)
    decision = ab_decision.to_deployment(
        name="ab-decision", parameters=args, interval=timedelta(minutes=p.deploy.decision_every_minutes)
    )
    when = p.deploy.cycle_cron or f"every {p.deploy.cycle_every_minutes} min"
    console.print(
        f"serving deployments: online-rl-cycle ({when}, for org and {len(schedules) - 1} team(s)), "
        f"ab-decision (every {p.deploy.decision_every_minutes} min, every team's test)"
    )
    serve(cycle, decision)


RepoOpt = Annotated[
    Path,
    typer.Option(
        help="The project's checkout on the cpu hosts, where their flow runs run (paths relative to it); recorded "
        "as an absolute path."
    ),
]


def _ensure_pools(*pools: str) -> None:
    """Create each work pool that the Prefect server lacks (type `process`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        for pool in pools:
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                template = ProcessWorker.get_default_base_job_template()
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
                console.print(f"created work pool {pool} (process)")


def deploy_cmd(
    repo: RepoOpt = Path("."),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Register the flows on a Prefect server's work pools (created when missing, type `process`).

    online-rl-cycle and ab-decision go to the cluster.cpu_pool on the schedules in params; the training
    step, train-candidate, to cluster.gpu_pool, started by each cycle with run_deployment
    (cluster.train_on=pool is added to the cycle's overrides). Then start workers:
    `prefect worker start --pool cpu` on hosts with the project repo, `--pool gpu` on GPU hosts. The
    params file and the repo are recorded as absolute paths (the cpu hosts' checkout). See the docs,
    "Run on a cluster" (docs/how-to/cluster.md)."""
    from datetime import timedelta

    from prefect.deployments.runner import EntrypointType

    from flows.ab_decision import ab_decision
    from flows.cycle import online_rl_cycle
    from flows.train_flow import train_candidate

    overrides = [*(set_ or []), "cluster.train_on=pool"]
    p = params_or_exit(params, overrides)
    if not os.environ.get("PREFECT_API_URL"):
        console.print("error: PREFECT_API_URL is not set: deployments live on a Prefect server (http://HOST:4200/api)")
        raise typer.Exit(2)
    cp = p.cluster
    _ensure_pools(cp.cpu_pool, cp.gpu_pool)
    args = {"params_file": str(params.resolve()), "overrides": overrides}
    by_module = {"entrypoint_type": EntrypointType.MODULE_PATH}  # workers import tabrl; no source dir to share
    # The cpu pool's flow runs run in the repo (a process worker otherwise starts each in a new temporary
    # directory, where params' relative paths, data/fim among them, name nothing); a gpu host has no such checkout.
    in_repo = {"job_variables": {"working_dir": str(repo.resolve())}}
    deployments = [
        online_rl_cycle.to_deployment(  # snapshots in paths.snapshots_repo, relative to the repo (working_dir)
            name="online-rl-cycle",
            parameters=args,
            work_pool_name=cp.cpu_pool,
            schedules=cycle_schedules(p),
            **by_module,
            **in_repo,
        ),
        ab_decision.to_deployment(
            name="ab-decision",
            parameters=args,
            work_pool_name=cp.cpu_pool,
            interval=timedelta(minutes=p.deploy.decision_every_minutes),
            **by_module,
            **in_repo,
        ),
        train_candidate.to_deployment(name=cp.train_deployment, work_pool_name=cp.gpu_pool, **by_module),
    ]
    for deployment in deployments:
        deployment.apply()
        console.print(f"deployed {deployment.flow_name}/{deployment.name} on pool {deployment.work_pool_name}")
