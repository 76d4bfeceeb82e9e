"""`tabrl promote`, `tabrl rollback`, `tabrl ab-status`: end or inspect the A/B test by hand.

Registered in tasks/cli.py."""

from __future__ import annotations

from tasks.config import DEFAULT_PARAMS_FILE
from tasks.console import ParamsOpt, SetOpt, console, fail, params_or_exit, print_table


def promote_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Promote the challenger: it becomes `champion` (alias) and serves 100 %; the decision is logged to MLflow."""
    _change("promote", params, set_)


def rollback_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Roll the challenger back: its arm is removed, the champion serves 100 %, the alias is deleted."""
    _change("rollback", params, set_)


def ab_status_cmd(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Per-arm live numbers since the challenger went live, and what the decision rule says now (changes nothing)."""
    from rich.table import Table

    from serving.store import CHALLENGER, CHAMPION, open_store
    from tasks.deploy.ab import arm_stats, decide

    p = params_or_exit(params, set_)
    with open_store(p.paths.database_url) as engine:
        stats = arm_stats(engine, p)
    table = Table(title="Live A/B numbers per arm")
    for col in ("arm", "model version", "requests", "pending", "suggest rate", "accept rate", "reward/request"):
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
        )
    print_table(table)
    if CHAMPION in stats and CHALLENGER in stats:
        d = decide(stats[CHAMPION], stats[CHALLENGER], p)
        console.print(f"rule: {d.action} ({d.reason})", highlight=False)
    else:
        console.print("no A/B test running", highlight=False)


def _change(action: str, params, set_) -> None:
    from serving.store import ArmError, open_store
    from tasks.deploy.errors import DeployError
    from tasks.deploy.promote import NoChallengerError, promote, rollback

    p = params_or_exit(params, set_)
    with open_store(p.paths.database_url) as engine:
        try:
            change = (promote if action == "promote" else rollback)(engine, p)
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
