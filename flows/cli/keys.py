"""`tabrl keys add | keys team | keys opt-out`, `tabrl teams` and `tabrl purge`: who may call the gateway, in which
team, whose requests are logged, and how long the log keeps them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.console import ParamsOpt, SetOpt, console, fail, params_or_exit
from tasks.core.config import DEFAULT_PARAMS_FILE
from tasks.core.store import open_store
from tasks.core.teams import ORG

keys_app = typer.Typer(help="API keys and the opt-in cohort.", no_args_is_help=True)
teams_app = typer.Typer(
    help="Teams: each its own adapter, cycle, A/B test and gate (docs/how-to/teams.md).", no_args_is_help=True
)
TEAM_HELP = "The key's team (its callers get the team's arms; `org`: no team, the organisation's)."


def _params(path: Path, overrides: list[str] | None):
    return params_or_exit(path, overrides)


def _fail(message: str, code: int = 2) -> None:
    fail(message, code)


REPORTS_HELP = (
    "The key's client reports every outcome itself (Continue's data destination, RLinf's fork): a completion it "
    "never reported within ingest.reported_timeout_s was not shown, never rejected."
)


@keys_app.command("add", epilog="Example: tabrl keys add alice --team payments --reports-outcomes")
def keys_add_cmd(
    user: Annotated[str, typer.Argument(help="User id the key maps to.")],
    reports_outcomes: Annotated[bool, typer.Option("--reports-outcomes", help=REPORTS_HELP)] = False,
    team: Annotated[str, typer.Option(help=TEAM_HELP)] = ORG,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Create an API key for USER and print it (only its hash is stored)."""
    from serving.auth import add_key

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        try:
            key = add_key(engine, user, reports_outcomes, team)
        except ValueError as err:
            _fail(str(err))
    typer.echo(key)


@keys_app.command("team", epilog="Example: tabrl keys team alice payments")
def keys_team_cmd(
    user: Annotated[str, typer.Argument(help="User id whose live keys move.")],
    team: Annotated[str, typer.Argument(help=TEAM_HELP)],
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Move USER's live keys to TEAM: completions served from now on are routed to and logged with it (rows already
    logged keep the team they were served with)."""
    from serving.auth import set_team

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        try:
            changed = set_team(engine, user, team)
        except ValueError as err:
            _fail(str(err))
    if not changed:
        _fail(f"{user!r} has no live API key; create one with `tabrl keys add {user} --team {team}`", 1)
    console.print(f"{user}: {changed} key(s) now in team {team}", highlight=False)


@teams_app.command("list", epilog="Example: tabrl teams list")
def teams_list_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Every team: its live keys, whether it is logged and shares its outcomes with the organisation's model, its
    code base, and its arms (none: it gets the organisation's)."""
    from rich.table import Table

    from flows.cli.console import print_table
    from serving.auth import read_teams
    from tasks.core.store import read_arms

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        found = {t["team"]: t for t in read_teams(engine)}
        arms = read_arms(engine, None)
    table = Table(title="Teams (org: the organisation's model, every caller without a team)")
    for column in ("team", "keys", "logged", "shares with org", "code base", "arms"):
        table.add_column(column)
    for name in sorted(set(found) | set(p.teams.sources) | {a.team for a in arms} - {ORG}):
        t = found.get(name, {"keys": 0, "opted_out": False, "shares_with_org": True})
        own = ", ".join(f"{a.name} {a.model_version} {a.share:.0%}" for a in arms if a.team == name)
        table.add_row(
            name,
            str(t["keys"]),
            "no (opted out)" if t["opted_out"] else "yes",
            "yes" if t["shares_with_org"] else "no",
            p.teams.sources.get(name, "(the organisation's)"),
            own or "the organisation's",
        )
    print_table(table)


@teams_app.command("opt-out", epilog="Example: tabrl teams opt-out payments")
def teams_opt_out_cmd(
    team: Annotated[str, typer.Argument(help="Team name.")],
    undo: Annotated[bool, typer.Option("--undo", help="Log the team's requests again.")] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Stop logging TEAM's requests (they are still served, by its arms or the organisation's); --undo logs them."""
    _team_flag(params, set_, team, opted_out=not undo)
    console.print(f"team {team}: {'opted in' if undo else 'opted out: served, never logged'}", highlight=False)


@teams_app.command("private", epilog="Example: tabrl teams private payments")
def teams_private_cmd(
    team: Annotated[str, typer.Argument(help="Team name.")],
    undo: Annotated[bool, typer.Option("--undo", help="Share its outcomes with the organisation again.")] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Keep TEAM's outcomes to its own adapter: the organisation's cycles stop training on them (rows they already
    snapshotted stay there); --undo shares them again."""
    _team_flag(params, set_, team, shares_with_org=undo)
    what = "shares its outcomes with the organisation's model" if undo else "trains its own adapter only"
    console.print(f"team {team}: {what}", highlight=False)


def _team_flag(params: Path, overrides: list[str] | None, team: str, **flags: bool) -> None:
    from serving.auth import set_team_flags

    p = _params(params, overrides)
    with open_store(p.paths.database_url) as engine:
        try:
            set_team_flags(engine, team, **flags)
        except ValueError as err:
            _fail(str(err))


@teams_app.command("data", epilog="Example: tabrl teams data payments")
def teams_data_cmd(
    team: Annotated[str, typer.Argument(help="Team name, with a code base in teams.sources.")],
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Split TEAM's code base (teams.sources.TEAM) into train and test files and write its held-out FIM samples and
    typing regions under paths.data_dir/teams/TEAM/ (its gate's; its first cycle writes them when missing)."""
    from tasks.sim.corpus import CorpusError
    from tasks.sim.team_data import data_dir_of, write_team_data

    p = _params(params, set_)
    try:
        stats = write_team_data(p, team)
    except (CorpusError, ValueError) as err:
        _fail(str(err))
    console.print(f"Wrote {data_dir_of(p, team)}/corpus and fim: {stats}", highlight=False)


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
