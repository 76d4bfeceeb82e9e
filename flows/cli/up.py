"""`tabrl up`: the always-on stack on one machine in one command (flows/stack.py), stopped by Ctrl-C."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.console import ParamsOpt, SetOpt, console, fail, params_or_exit, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE


def up_cmd(
    gateways: Annotated[
        int,
        typer.Option(
            min=1,
            help="Gateway processes sharing serving.port. More than 1 needs a PostgreSQL log store "
            "(paths.database_url) and serving.redis_url; on SQLite the gateway is one process.",
        ),
    ] = 1,
    prefect_port: Annotated[int, typer.Option(help="Port of the Prefect server (API and UI).")] = 4200,
    mlflow_port: Annotated[
        int, typer.Option(help="Port of the MLflow server (not started when paths.mlflow_tracking_uri is http://...).")
    ] = 5000,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="Serve without API keys (local trials only), as `tabrl serve --no-auth`.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the processes and write supervisord.conf; start nothing.")
    ] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Start the whole stack under supervisord and keep it up: the Prefect server, the MLflow server, the
    deployments on their schedules, a Prefect worker per pool, the gateway (and the champion's vLLM server on
    serving.backend=vllm). Each process logs to {paths.state_dir}/up/logs/NAME.log and is restarted when it
    dies. Ctrl-C (or SIGTERM) stops everything it started.

    Example: tabrl up --no-auth"""
    from flows.stack import StackError, plan

    overrides = [*(set_ or []), *(["serving.auth=false"] if no_auth else [])]
    p = params_or_exit(params, overrides)
    if gateways > 1 and (p.paths.database_url.startswith("sqlite") or not p.serving.redis_url):
        fail(
            f"--gateways {gateways}: replicas need a PostgreSQL log store and a shared Redis "
            f"(paths.database_url is {p.paths.database_url!r}, serving.redis_url is {p.serving.redis_url!r}); "
            "on SQLite run one gateway",
            2,
        )
    stack = plan(p, params, overrides, prefect_port, mlflow_port, gateways)
    _print_plan(stack)
    if dry_run:
        from flows.stack import render

        stack.home.mkdir(parents=True, exist_ok=True)
        stack.conf.write_text(render(stack, Path.cwd()))
        console.print(f"wrote {stack.conf} (nothing started)", highlight=False)
        return
    try:
        _run(stack)
    except StackError as err:
        fail(str(err), 1)


def _print_plan(stack) -> None:
    table = Table(title="tabrl up: the processes")
    for col in ("process", "answers at", "log"):
        table.add_column(col)
    for program in stack.programs:
        table.add_row(program.name, program.ready_url or "-", str(stack.log(program.name)))
    print_table(table)


def _run(stack) -> None:
    """Bring the stack up in order, wait for Ctrl-C or SIGTERM, and stop all of it whatever happened."""
    from flows.stack import FIRST, StackError, run_step, serve_first_champion, start, start_rest, stop, wait_ready
    from tasks.core.procs import exit_on_sigterm

    exit_on_sigterm()
    # Ctrl-C must stop the stack even where SIGINT came in ignored (a shell starts background jobs so, and
    # Python then leaves it ignored): KeyboardInterrupt is what reaches the `finally` below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    running = start(stack, Path.cwd())
    try:
        for name, seconds in wait_ready(running, list(FIRST)).items():
            console.print(f"{name} up ({seconds:.1f} s)")
        run_step(running, "deploy", stack.deploy)
        console.print(f"deployments registered on their schedules ({stack.log('deploy')})", highlight=False)
        if stack.vllm:
            run_step(running, "vllm", stack.vllm_start)
            console.print("the champion's vLLM server is up", highlight=False)
        elif (label := serve_first_champion(stack)) is not None:
            console.print(f"the champion {label} is the one arm", highlight=False)
        start_rest(running)
        rest = [p.name for p in stack.programs if p.name not in FIRST]
        for name, seconds in wait_ready(running, rest).items():
            console.print(f"{name} up ({seconds:.1f} s)")
        console.print(
            f"up: gateway {stack.gateway_url}, Prefect UI {stack.prefect_url}, MLflow UI {stack.mlflow_url}\n"
            f"in another shell: export PREFECT_API_URL={stack.env['PREFECT_API_URL']}. Ctrl-C stops everything.",
            highlight=False,
        )
        while running.proc.poll() is None:
            running.look()
            time.sleep(2.0)
        raise StackError(f"supervisord exited ({running.proc.returncode}): see {stack.home / 'supervisord.log'}")
    except KeyboardInterrupt:
        console.print("stopping ...")
    finally:
        killed = stop(running)
        left = f"; also stopped: {', '.join(killed)}" if killed else ""
        console.print(f"stopped every process of this stack{left}", highlight=False)
