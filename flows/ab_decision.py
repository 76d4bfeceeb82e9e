"""`ab_decision`: live per-arm stats -> decide -> promote, roll back or keep collecting (every few minutes).

Run once: `python -m flows.ab_decision` (ephemeral Prefect) or `tabrl ab-status` to only look.
Scheduled by `tabrl schedule` every `deploy.decision_every_minutes`. The rule is in tasks/deploy/ab.py.
With vLLM arms it first loads again any live adapter a restarted server lost (`tasks/deploy/arms.py`). Each team
with arms of its own has its own test, decided on its own numbers (the organisation's first); each decision holds
its team's arms slot (flows/slots.py): a cycle's rollout and a decision never change a team's arms at the same
moment.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.slots import arms_slot
from tasks.core.config import DEFAULT_PARAMS_FILE, Params, load_params
from tasks.core.store import CHALLENGER, CHAMPION, ArmError, open_store, read_arms
from tasks.core.teams import ORG
from tasks.deploy import ab
from tasks.deploy.arms import sync_adapters
from tasks.deploy.errors import DeployError
from tasks.deploy.promote import DeployChange, log_decision, promote, rollback
from tasks.deploy.registry import Registry


def _transient(task, task_run, state) -> bool:
    """Retry store and tracking-server hiccups, never a state that needs a person to look at it."""
    return not isinstance(state.result(raise_on_failure=False), (DeployError, ArmError))


@task(retries=3, retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)
def teams_with_arms(params: Params) -> list[str]:
    """The organisation, then every team with arms of its own (by name)."""
    with open_store(params.paths.database_url) as engine:
        return [ORG, *sorted({a.team for a in read_arms(engine, None)} - {ORG})]


@task(retries=3, retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)
def live_stats(params: Params, team: str = ORG) -> dict[str, ab.ArmStats]:
    with open_store(params.paths.database_url) as engine:  # a fresh store has no A/B test: not an error
        return ab.arm_stats(engine, params, team=team)


@task(retries=2, retry_delay_seconds=[5, 15], retry_condition_fn=_transient, cache_policy=NO_CACHE)
def apply_decision(params: Params, decision: ab.Decision, team: str = ORG) -> DeployChange:
    change = promote if decision.action == "promote" else rollback
    with open_store(params.paths.database_url) as engine:
        return change(engine, params, decision, team)


@task(retries=3, retry_delay_seconds=[2, 5, 15], cache_policy=NO_CACHE)
def record_decision(params: Params, decision: ab.Decision, stats: dict[str, ab.ArmStats], team: str = ORG) -> str:
    registry = Registry(params, team)
    return log_decision(
        params,
        decision,
        champion=registry.aliased(CHAMPION),
        challenger=registry.aliased(CHALLENGER),
        applied=False,
        stats=stats,
        team=team,
    )


@task(retries=2, retry_delay_seconds=[5, 15], cache_policy=NO_CACHE)
def sync_live_adapters(params: Params) -> list[str]:
    """Each live arm's engine serves again what it lost (a restarted vLLM server's adapters; the arms table is the
    truth)."""
    return sync_adapters(params)


@flow(name="ab-decision", log_prints=True)
def ab_decision(
    params_file: str = str(DEFAULT_PARAMS_FILE), overrides: list[str] | None = None, team: str | None = None
) -> dict[str, ab.Decision]:
    """Decide on each running A/B test (`team`'s only, when given), by team; a promote or rollback is applied and
    recorded, a continue recorded."""
    params = load_params(params_file, overrides or [])
    for line in sync_live_adapters(params):
        print(f"loaded again: {line}")
    decisions = {}
    for scope in teams_with_arms(params) if team is None else [team]:
        with arms_slot(params.paths.database_url, scope):  # never while a cycle rolls out its challenger
            decisions[scope] = _decide(params, scope)
    return decisions


def _decide(params: Params, team: str) -> ab.Decision:
    who = "" if team == ORG else f"team {team}: "
    stats = live_stats(params, team)
    if CHAMPION not in stats or CHALLENGER not in stats:
        decision = ab.Decision("continue", f"no A/B test running (live arms: {sorted(stats)})", {})
        print(who + decision.reason)
        return decision
    decision = ab.decide(stats[CHAMPION], stats[CHALLENGER], params)
    print(f"{who}{decision.action}: {decision.reason}")
    if decision.action == "continue":
        record_decision(params, decision, stats, team)
    else:
        apply_decision(params, decision, team)
    return decision


if __name__ == "__main__":
    ab_decision()
