"""`tabrl promote`, `tabrl rollback`, `tabrl ab-status`: end or inspect the A/B test by hand; `tabrl vllm ...`:
the base's vLLM server; `tabrl export --merged`: an adapter version as a full checkpoint; `tabrl model-retention`:
delete this host's copies of retired model versions.

Registered in flows/cli/main.py."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.console import OutputOpt, ParamsOpt, SetOpt, console, fail, params_or_exit, print_json, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE
from tasks.core.teams import ORG, check_team

TeamOpt = Annotated[str, typer.Option(help="Whose A/B test (`org`: the organisation's).")]


def promote_cmd(team: TeamOpt = ORG, params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Promote the challenger: it becomes `champion` (alias) and serves 100 %; the decision is logged to MLflow."""
    _change("promote", team, params, set_)


def rollback_cmd(team: TeamOpt = ORG, params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Roll the challenger back: its arm is removed, the champion serves 100 %, the alias is deleted (a team whose
    champion is the organisation's goes back to the organisation's arms)."""
    _change("rollback", team, params, set_)


def ab_status_cmd(
    team: Annotated[str | None, typer.Option(help="One team's test only (default: every team's).")] = None,
    output: OutputOpt = "table",
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Per-arm live numbers since the challenger went live (latency p50/p95 of the same requests), and what the
    decision rule says now (changes nothing), for each team with arms of its own (the organisation's first).
    Completions never shown (cancelled: the client hung up before the answer; not shown: the client said so) are
    counted apart, in no rate: the cancel rate is a latency guardrail.

    Example: tabrl ab-status --set ingest.feedback_timeout_s=30"""

    from tasks.core.store import CHALLENGER, CHAMPION, open_store, read_arms
    from tasks.deploy.ab import arm_stats, decide

    p = params_or_exit(params, set_)
    with open_store(p.paths.database_url) as engine:
        scopes = [team] if team else [ORG, *sorted({a.team for a in read_arms(engine, None)} - {ORG})]
        by_team = {scope: arm_stats(engine, p, team=scope) for scope in scopes}
    rules = {
        scope: decide(stats[CHAMPION], stats[CHALLENGER], p) if CHAMPION in stats and CHALLENGER in stats else None
        for scope, stats in by_team.items()
    }
    if output == "json":  # {team: {"arms": {arm: every number}, "rule": {action, reason, numbers} or null}}
        print_json(
            {
                scope: {
                    "arms": {name: s.as_record() for name, s in stats.items()},
                    "rule": asdict(rules[scope]) if rules[scope] else None,  # type: ignore[arg-type]
                }
                for scope, stats in by_team.items()
            }
        )
        return
    for scope, stats in by_team.items():
        _ab_table(scope, stats)
        rule = rules[scope]
        console.print(f"rule: {rule.action} ({rule.reason})" if rule else "no A/B test running", highlight=False)


def _ab_table(team: str, stats: dict) -> None:
    from rich.table import Table

    who = "" if team == ORG else f"team {team}: "
    table = Table(title=f"{who}Live A/B numbers per arm (p50, p95: latency of the same requests)")
    columns = ("arm", "model version", "requests", "pending", "suggest rate", "accept rate", "reward/request")
    for col in (*columns, "p50 ms", "p95 ms", "cancelled", "not shown", "cancel rate"):
        table.add_column(col, justify="right")
    for s in stats.values():
        table.add_row(
            s.arm,
            s.model_version,
            str(s.requests),
            str(s.pending),
            f"{s.suggest_rate:.3f}",
            f"{s.accept_rate:.3f}",
            f"{s.reward_per_request:.4f}",
            f"{s.latency.p50_ms:.1f}" if s.latency else "-",
            f"{s.latency.p95_ms:.1f}" if s.latency else "-",
            str(s.cancelled),
            str(s.not_shown),
            f"{s.cancel_rate:.3f}",
        )
    print_table(table)


def model_retention_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be deleted.")] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Delete local copies of retired model versions (candidates, downloads no arm serves and no alias names)
    written more than deploy.retired_retention_hours ago; the registry keeps every version. Old log rows are
    `tabrl purge`'s; every online cycle runs this too.

    Example: tabrl model-retention --dry-run --set deploy.retired_retention_hours=0"""
    from rich.table import Table

    from tasks.core.store import open_store
    from tasks.deploy.model_retention import delete_retired, plan_model_retention

    p = params_or_exit(params, set_)
    with open_store(p.paths.database_url) as engine:
        plan = plan_model_retention(engine, p)
    deleted = [c for c in plan if c.retired] if dry_run else delete_retired(plan)
    verb = "would delete" if dry_run else "deleted"
    table = Table(title=f"Local model copies (deploy.retired_retention_hours={p.deploy.retired_retention_hours:g})")
    for col in ("path", "age h", "MB", "action", "why"):
        table.add_column(col, justify="right" if col in ("age h", "MB") else "left")
    for c in plan:
        action = verb if c.retired else "keep"
        table.add_row(str(c.path), f"{c.age_hours:.1f}", f"{c.size_bytes / 1e6:.1f}", action, c.why)
    print_table(table)
    console.print(
        f"{verb} {len(deleted)} of {len(plan)} local copies ({sum(c.size_bytes for c in deleted) / 1e6:.1f} MB)",
        highlight=False,
    )


def _change(action: str, team: str, params, set_) -> None:
    from tasks.core.store import ArmError, open_store
    from tasks.deploy.errors import DeployError
    from tasks.deploy.promote import NoChallengerError, promote, rollback

    p = params_or_exit(params, set_)
    try:
        check_team(team)
    except ValueError as err:
        fail(f"--team: {err}", 2)
    with open_store(p.paths.database_url) as engine:
        try:
            change = (promote if action == "promote" else rollback)(engine, p, None, team)
        except NoChallengerError as err:
            fail(f"{err}.", 2)
        except (DeployError, ArmError) as err:
            fail(str(err), 1)
    champion = change.champion.label if change.champion else "none"
    challenger = change.challenger.label if change.challenger else "none"
    console.print(
        f"{action}: champion is now {champion} (challenger was {challenger}); live arms: "
        + ", ".join(f"{a.name}={a.model_version}@{a.share:g}" for a in change.arms),
        highlight=False,
    )
    console.print(f"decision recorded in MLflow run {change.record_run_id}", highlight=False)


vllm_app = typer.Typer(
    help="The base's vLLM server: start it with the champion's arm, load lost adapters again, see what it serves.",
    no_args_is_help=True,
)


@vllm_app.command("start")
def vllm_start_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Start (or find) the champion's base server with runtime LoRA, load an adapter champion, point the arms at it.

    Example: tabrl vllm start --set serving.backend=vllm --set serving.vllm_python=.venv-vllm/bin/python"""
    from tasks.core.engines import engine_class
    from tasks.core.engines.base import ServeError
    from tasks.deploy.arms import serve_champion
    from tasks.deploy.errors import DeployError

    p = params_or_exit(params, set_)
    if not engine_class(p.serving.backend).remote:
        fail(
            f"serving.backend is {p.serving.backend}: there is no vLLM server to start (--set serving.backend=vllm)", 2
        )
    try:
        arm = serve_champion(p)
    except (ServeError, DeployError) as err:
        fail(str(err), 1)
    console.print(f"champion {arm.model_version} served by {arm.model_uri} as {arm.served_model}", highlight=False)


@vllm_app.command("sync")
def vllm_sync_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Load every live arm's adapter its vLLM server lost (after a restart): the arms table is the truth.

    Example: tabrl vllm sync"""
    from tasks.core.engines.base import ServeError
    from tasks.deploy.arms import sync_adapters

    p = params_or_exit(params, set_)
    try:
        loaded = sync_adapters(p)
    except ServeError as err:
        fail(str(err), 1)
    for line in loaded or ["every live adapter is loaded"]:
        console.print(line, highlight=False)


@vllm_app.command("status")
def vllm_status_cmd(output: OutputOpt = "table", params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """The vLLM servers the arms use and what each serves now (base model and loaded adapters).

    Example: tabrl vllm status"""
    from rich.table import Table

    from tasks.core.engines import engine_class
    from tasks.core.store import open_store, read_arms
    from tasks.core.vllm import VllmError, served_models

    p = params_or_exit(params, set_)
    with open_store(p.paths.database_url) as engine:
        arms = [a for a in read_arms(engine, None) if engine_class(a.backend).remote]
    rows = []  # one per model a server serves (its base, its adapters), or one per server that did not answer
    for url in sorted({a.model_uri for a in arms}):
        try:
            cards = served_models(url)
        except VllmError as err:
            rows.append({"server": url, "model": None, "parent": None, "arms": [], "error": str(err)})
            continue
        for name, card in cards.items():
            users = [
                a.name if a.team == ORG else f"{a.team}/{a.name}"
                for a in arms
                if a.model_uri == url and a.served_model == name
            ]
            rows.append({"server": url, "model": name, "parent": card.get("parent"), "arms": users, "error": None})
    if output == "json":
        print_json(rows)
        return
    table = Table(title="vLLM servers of the live arms")
    for col in ("server", "model", "parent", "arms"):
        table.add_column(col)
    for row in rows:
        model = row["model"] if row["error"] is None else f"unreachable: {row['error']}"
        table.add_row(row["server"], model, row["parent"] or "-", ", ".join(row["arms"]) or "-")
    print_table(table)


def export_cmd(
    model: Annotated[str, typer.Argument(help="A LoRA adapter version: a directory or models:/NAME/VERSION.")],
    out: Annotated[Path, typer.Option(help="Directory for the full checkpoint.")],
    merged: Annotated[bool, typer.Option("--merged", help="Merge the adapter into its base (required).")] = False,
    base: Annotated[
        Path | None, typer.Option(help="The base checkpoint (default: the registry's, or the record's).")
    ] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Write an adapter version merged into its base as a full Hugging Face checkpoint (for tools without LoRA).

    Example: tabrl export models:/tabrl-completion/4 --merged --out models/v4-merged"""
    from tasks.core.adapters import AdapterBaseError, is_adapter
    from tasks.core.generate import save_merged
    from tasks.deploy.errors import DeployError
    from tasks.deploy.model_cache import resolve_model_dir
    from tasks.deploy.registry import Registry

    p = params_or_exit(params, set_)
    if not merged:
        fail("only --merged exports exist: pass --merged to write the adapter merged into its base", 2)
    if out.exists():
        fail(f"{out} exists; choose a new --out (nothing is overwritten)", 2)
    try:
        adapter_dir = resolve_model_dir(model, p)
        if not is_adapter(adapter_dir):
            fail(f"{model} is a full checkpoint already ({adapter_dir}); there is no adapter to merge", 2)
        if base is None and model.startswith("models:/"):
            registry = Registry(p)
            base = resolve_model_dir(registry.base_of(registry.version_of(model)).uri, p)
        written = save_merged(adapter_dir, base, out)
    except (DeployError, AdapterBaseError) as err:
        fail(str(err), 2)
    console.print(f"wrote {written}: {model} merged into its base", highlight=False)
