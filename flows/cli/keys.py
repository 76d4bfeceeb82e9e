"""`tabrl keys add | keys opt-out` and `tabrl purge`: who may call the gateway, whose requests are logged,
and how long the log keeps them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.console import ParamsOpt, SetOpt, console, fail, params_or_exit
from tasks.core.config import DEFAULT_PARAMS_FILE
from tasks.core.store import open_store

keys_app = typer.Typer(help="API keys and the opt-in cohort.", no_args_is_help=True)


def _params(path: Path, overrides: list[str] | None):
    return params_or_exit(path, overrides)


def _fail(message: str, code: int = 2) -> None:
    fail(message, code)


REPORTS_HELP = (
    "The key's client reports every outcome itself (Continue's data destination, RLinf's fork): a completion it "
    "never reported within ingest.reported_timeout_s was not shown, never rejected."
)


@keys_app.command("add", epilog="Example: tabrl keys add alice --reports-outcomes")
def keys_add_cmd(
    user: Annotated[str, typer.Argument(help="User id the key maps to.")],
    reports_outcomes: Annotated[bool, typer.Option("--reports-outcomes", help=REPORTS_HELP)] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Create an API key for USER and print it (only its hash is stored)."""
    from serving.auth import add_key

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        try:
            key = add_key(engine, user, reports_outcomes)
        except ValueError as err:
            _fail(str(err))
    typer.echo(key)


@keys_app.command("reports-outcomes", epilog="Example: tabrl keys reports-outcomes alice")
def keys_reports_cmd(
    user: Annotated[str, typer.Argument(help="User id whose live keys change.")],
    undo: Annotated[bool, typer.Option("--undo", help="Its client does not report: silence is a rejection.")] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Mark USER's live keys as a client that reports every outcome itself (completions served from now on);
    --undo: silence after ingest.feedback_timeout_s is a rejection again."""
    from serving.auth import set_reports_outcomes

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        changed = set_reports_outcomes(engine, user, not undo)
    if not changed:
        _fail(f"{user!r} has no live API key; create one with `tabrl keys add {user}`", 1)
    what = "reports its own outcomes" if not undo else "does not report its outcomes (silence is a rejection)"
    console.print(f"{user}: {changed} key(s); the client {what}", highlight=False)


@keys_app.command("opt-out", epilog="Example: tabrl keys opt-out alice")
def keys_opt_out_cmd(
    user: Annotated[str, typer.Argument(help="User id.")],
    undo: Annotated[bool, typer.Option("--undo", help="Opt the user back in.")] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Stop logging USER's requests (they are still served); --undo logs them again."""
    from serving.auth import set_opt_out

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        set_opt_out(engine, user, not undo)
    console.print(f"{user}: {'opted in' if undo else 'opted out'}")


def purge_cmd(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than", help="Delete completions and feedback older than this: NUMBER + s|m|h|d|w, e.g. 30d."
        ),
    ],
    batch: Annotated[int, typer.Option(help="Rows deleted per transaction.", min=1)] = 1000,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only count what would be deleted.")] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Retention: delete logged completions (with their feedback) and feedback older than --older-than."""
    from serving.retention import DurationError, parse_duration, purge

    try:
        seconds = parse_duration(older_than)
    except DurationError as err:
        _fail(f"--older-than: {err}")
    if seconds <= 0:
        _fail("--older-than must be longer than 0 s")
    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        done = purge(engine, seconds, batch=batch, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    console.print(
        f"{verb} {done.completions} completions, {done.feedback} feedback, {done.late_feedback} late feedback "
        f"older than {older_than}"
    )
