"""End an A/B test: promote the challenger or roll it back, and record every decision in MLflow.

Two stores change together: MLflow aliases (which version is champion / challenger) and the log
store's arms (what the gateways serve). They cannot share a transaction, so the order is chosen to
keep traffic safe:

* promote: move the aliases, then swap the arms in one transaction; when the arm swap fails the
  aliases are put back before the error propagates.
* rollback: swap the arms first (stop serving the challenger as soon as possible), then delete the
  alias. When the alias delete fails, the arms are already safe and running rollback again finishes
  the job (a challenger alias without a challenger arm is still a challenger to roll back).

Arms keep their backend and `model_uri`: promoting hands the challenger's arm (its loaded model, its
vLLM server, or its adapter on the base's server) the champion's name at share 1.0. What the arms no
longer served held is retired at once (`rollout.retire`): a rolled-back challenger's adapter is
unloaded, and so is a promoted champion's predecessor; a full-weight server of its own is stopped.
An adapter is promoted only over a champion on the same base (its weights' sha256).

Each team promotes and rolls back its own challenger (its arms, its registered model's aliases). A team whose
champion is still the organisation's (no champion alias of its own) goes back to the organisation's arms on a
rollback: its arms are removed, and its callers follow the organisation's champion again.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mlflow.entities import Metric
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from tasks.core import vocab
from tasks.core.adapters import AdapterBaseError, check_base
from tasks.core.config import Params
from tasks.core.engines import engine_class
from tasks.core.engines.base import ServeError
from tasks.core.store import CHALLENGER, CHAMPION, Arm, ArmError, read_arms, replace_arms
from tasks.core.teams import ORG
from tasks.deploy.ab import ArmStats, Decision, arm_stats, decide
from tasks.deploy.errors import DeployError
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import retire
from tasks.deploy.tracking import as_flat_tags, experiment_id, tracking_client
from tasks.deploy.versions import ModelVersion

DECISIONS_DESCRIPTION = (
    "tabrl A/B decisions: one run per look at the live test (promote, rollback or continue), with the "
    "per-arm numbers as ab/* metrics and decision.json; the cycle run that made the challenger is tabrl.cycle_run_id."
)
OUTCOME = {"promote": "promoted", "rollback": "rolled back"}  # how a cycle run's name ends after the decision


class NoChallengerError(DeployError):
    """Nothing is under test: no challenger arm is live and no version carries the challenger alias."""


@dataclass(frozen=True)
class DeployChange:
    action: vocab.ChangeAction
    champion: ModelVersion | None  # the champion after the change
    challenger: ModelVersion | None  # the version that was under test
    arms: list[Arm]  # the live arms after the change
    removed: list[Arm]  # arms no longer served (what they held on vLLM servers is retired)
    record_run_id: str  # the MLflow decision record


def promote(engine: Engine, params: Params, decision: Decision | None = None, team: str = ORG) -> DeployChange:
    """`team`'s challenger -> its champion (alias) and its only arm at share 1.0; the old champion arm is removed."""
    live = read_arms(engine, team)
    registry = Registry(params, team)
    arm, version = _challenger(live, registry, "promote")
    if arm is None or version is None:
        raise DeployError(
            f"cannot promote: the challenger is half set up (arm: {arm.model_version if arm else 'none'}, "
            f"alias: {version.label if version else 'none'}); run `tabrl rollback` to clear it"
        )
    if arm.model_version != version.label:
        raise DeployError(
            f"cannot promote: the challenger arm serves {arm.model_version} but the "
            f"{CHALLENGER!r} alias points at {version.label}; fix the alias or roll back"
        )
    champion_arm = next((a for a in live if a.name == CHAMPION), None)
    if champion_arm is not None:
        _check_same_base(arm, champion_arm)
    decision = decision or _manual("promote", engine, params, team)
    before = registry.aliased(CHAMPION)
    registry.set_alias(CHAMPION, version.version)
    registry.delete_alias(CHALLENGER)
    new_arms = [replace(arm, name=CHAMPION, share=1.0)]
    try:
        replace_arms(engine, new_arms, team)
    except (SQLAlchemyError, ArmError):
        if before is not None:
            registry.set_alias(CHAMPION, before.version)
        else:
            registry.delete_alias(CHAMPION)
        registry.set_alias(CHALLENGER, version.version)
        raise
    record = log_decision(params, decision, champion=version, challenger=version, applied=True, team=team)
    removed = [a for a in live if a.name != CHALLENGER]
    retire(removed, params)
    return DeployChange("promote", version, version, new_arms, removed, record)


def rollback(engine: Engine, params: Params, decision: Decision | None = None, team: str = ORG) -> DeployChange:
    """`team`'s challenger arm removed, its champion arm at share 1.0 (a team whose champion is the organisation's:
    its arms removed), its challenger alias deleted."""
    live = read_arms(engine, team)
    registry = Registry(params, team)
    arm, version = _challenger(live, registry, "roll back")
    champion_arm = next((a for a in live if a.name == CHAMPION), None)
    if champion_arm is None:
        raise DeployError(
            f"cannot roll back: no {CHAMPION!r} arm is live to take the traffic (live arms: {[a.name for a in live]})"
        )
    decision = decision or _manual("rollback", engine, params, team)
    champion = registry.aliased(CHAMPION)
    follows_org = team != ORG and champion is None  # the team's champion arm is the organisation's
    new_arms = [] if follows_org else [replace(champion_arm, share=1.0)]
    replace_arms(engine, new_arms, team)
    registry.delete_alias(CHALLENGER)
    if follows_org:
        champion = Registry(params).aliased(CHAMPION)
    record = log_decision(params, decision, champion=champion, challenger=version, applied=True, team=team)
    removed = live if follows_org else [a for a in live if a.name != CHAMPION]
    retire(removed, params)
    return DeployChange("rollback", champion, version, new_arms, removed, record)


def _check_same_base(challenger: Arm, champion: Arm) -> None:
    """Refuse to promote an adapter over a champion on another base: the next cycle would continue it on the
    champion's base, where its weights mean something else."""
    if challenger.adapter is None:
        return
    base = champion.model_uri
    try:
        base = engine_class(champion.backend).base_of(champion)
        if (Path(base) / "config.json").is_file():  # a checkpoint this host sees: compare the weights
            check_base(challenger.adapter, base, "promote")
    except (AdapterBaseError, ServeError) as err:
        raise DeployError(f"cannot promote {challenger.model_version} over the champion on {base}: {err}") from err


def _challenger(live: list[Arm], registry: Registry, verb: str) -> tuple[Arm | None, ModelVersion | None]:
    arm = next((a for a in live if a.name == CHALLENGER), None)
    version = registry.aliased(CHALLENGER)
    if arm is None and version is None:
        raise NoChallengerError(
            f"nothing to {verb}: no {CHALLENGER!r} arm is live and no version of "
            f"{registry.name!r} has the {CHALLENGER!r} alias"
        )
    return arm, version


def _manual(action: vocab.ChangeAction, engine: Engine, params: Params, team: str) -> Decision:
    """A by-hand decision, recorded with the live numbers and what the rule would have said."""
    stats = arm_stats(engine, params, team=team)
    if CHAMPION in stats and CHALLENGER in stats:
        rule = decide(stats[CHAMPION], stats[CHALLENGER], params)
        return Decision(action, f"by hand (the rule says {rule.action}: {rule.reason})", rule.numbers)  # type: ignore[arg-type]
    return Decision(action, "by hand (no live numbers for both arms)", {})  # type: ignore[arg-type]


def log_decision(
    params: Params,
    decision: Decision,
    *,
    champion: ModelVersion | None,
    challenger: ModelVersion | None,
    applied: bool,
    stats: dict[str, ArmStats] | None = None,
    team: str = ORG,
) -> str:
    """One run in `deploy.decisions_experiment` per decision: action, reason, `ab/*` numbers, the record
    as `decision.json`. A promote or rollback also tells the challenger's story where it is read: its
    cycle run gets the outcome as tags and at the end of its name (`... → promoted`), its registered
    version's description the decision and its p-values."""
    client = tracking_client(params)
    exp = experiment_id(client, params.deploy.decisions_experiment, params, DECISIONS_DESCRIPTION)
    label = challenger.label if challenger else "none"
    tags = {
        vocab.KIND: "ab_decision",
        vocab.ACTION: decision.action,
        vocab.REASON: decision.reason,
        vocab.APPLIED: str(applied).lower(),
        vocab.CHALLENGER_VERSION: label,
        vocab.CHAMPION_VERSION: champion.label if champion else "none",
        vocab.TEAM: team,
    }
    if challenger and challenger.run_id:
        tags[vocab.CYCLE_RUN_ID] = challenger.run_id
    run_id = client.create_run(exp, run_name=f"{decision.action}-{label}").info.run_id
    metrics = [Metric(f"ab/{k}", float(v), int(time.time() * 1000), 0) for k, v in decision.numbers.items()]
    client.log_batch(run_id, metrics=metrics, tags=as_flat_tags(tags))
    record = {
        "decision": asdict(decision),
        "applied": applied,
        "champion": champion.label if champion else None,
        "challenger": label,
        "team": team,
        "stats": {k: v.as_record() for k, v in (stats or {}).items()},
    }
    client.log_text(run_id, json.dumps(record, indent=2, sort_keys=True), "decision.json")
    client.set_terminated(run_id)
    if applied and challenger and decision.action != "continue":
        Registry(params, team).append_description(challenger, decision_note(decision, run_id))
        if challenger.run_id:
            client.log_batch(
                challenger.run_id,
                metrics=metrics,
                tags=as_flat_tags({vocab.AB_DECISION: decision.action, vocab.AB_REASON: decision.reason}),
            )
            name = client.get_run(challenger.run_id).info.run_name or ""
            client.update_run(challenger.run_id, name=f"{name.split(' → ')[0]} → {OUTCOME[decision.action]}")
    return run_id


def decision_note(decision: Decision, record_run_id: str) -> str:
    """The A/B decision as a paragraph of a version's description: action, reason, p-values."""
    n = decision.numbers
    if "reward_p" in n and "accept_p" in n:
        tests = (
            f"p-values: reward per request (Welch's t) {n['reward_p']:.3g}, "
            f"accept rate (two-proportion z) {n['accept_p']:.3g}, at alpha {n['alpha']:.3g}."
        )
    else:
        tests = "p-values: none (no live numbers for both arms)."
    return f"A/B decision: **{OUTCOME[decision.action]}**: {decision.reason}. {tests} Record: run `{record_run_id}`."
