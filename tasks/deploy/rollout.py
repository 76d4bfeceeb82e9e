"""Roll a gated candidate out as the challenger, reversibly, in one Prefect transaction.

    champion arm (share 1 - s) + challenger arm (share s = deploy.challenger_share)

Steps, each a task whose `on_rollback` hook undoes it when a later step fails:

1. `serve_version`: the serving engine of serving.backend (`tasks/core/engines`) makes the new version ready
   before any user is routed to it: on vLLM a LoRA adapter is loaded at runtime on its base's one server and asked
   once, a full checkpoint gets a server of its own (blue/green); embedded, nothing starts (gateways load it on
   the next request) and an adapter's base is checked. Rollback: the engine undoes it (`unserve`).
2. `set_challenger_alias`: MLflow alias `challenger` -> the new version. Rollback restores the
   previous alias (or deletes it).
3. `swap_arms`: the live arm set in the log store, in one database transaction. Rollback restores
   the previous arm set.
4. `check_arms`: the live arm set reads back as written (a failure here, or anywhere inside the
   transaction, undoes 1-3).

After the switch, what the previous challenger held is retired (`retire`: its adapter unloaded, or
its server stopped: the arm's engine's `retire`), as promote and rollback do for the arms they remove.

A team's rollout changes its own arms and aliases only. A team with no arms of its own (its callers get the
organisation's) gets its first two: the organisation's champion as it is now, as its champion, and its challenger.
What is retired is checked against every team's live arms: a team's arm may serve the organisation's champion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import get_transaction, transaction

from tasks.core.adapters import is_adapter
from tasks.core.config import Params
from tasks.core.engines import engine_for
from tasks.core.engines.base import Served, ServeError
from tasks.core.store import CHALLENGER, CHAMPION, Arm, open_store, read_arms, replace_arms
from tasks.core.teams import ORG
from tasks.deploy.errors import DeployError
from tasks.deploy.registry import Registry
from tasks.deploy.versions import ModelVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    version: ModelVersion
    arms: list[Arm]  # live after the rollout
    previous_arms: list[Arm]
    served: Served


def challenger_arms(
    live: list[Arm], version: ModelVersion, served: Served, params: Params, team: str = ORG
) -> list[Arm]:
    """`team`'s champion at 1 - share plus the new challenger at share (any earlier challenger is replaced). `live`:
    the team's arms, or the organisation's when the team has none (its champion is then the organisation's)."""
    champion = next((a for a in live if a.name == CHAMPION), None)
    if champion is None:
        raise DeployError(
            f"no live '{CHAMPION}' arm to roll out beside (arms: {[a.name for a in live]}); "
            "start the gateway with `tabrl serve --model DIR` first"
        )
    share = params.deploy.challenger_share
    challenger = Arm(
        CHALLENGER,
        version.label,
        served.model_uri,
        params.serving.backend,
        share,
        served.served_model,
        served.adapter,
        team,
    )
    return [replace(champion, share=1.0 - share, team=team), challenger]


@task(name="serve-version", cache_policy=NO_CACHE)
def serve_version(version: ModelVersion, model_dir: str, base_dir: str | None, params: Params) -> Served:
    """Make the version servable (see the module docstring) and say where; recorded for the rollback."""
    adapter = is_adapter(model_dir)
    if adapter and base_dir is None:
        raise DeployError(f"{version.label} is a LoRA adapter: its base checkpoint directory is needed to serve it")
    try:
        served = engine_for(params.serving.backend, params).serve(version.label, model_dir, base_dir)
    except ServeError as err:
        raise DeployError(f"cannot serve {version.label}: {err}") from err
    txn = get_transaction()
    txn.set("params", params)
    txn.set("served", served)
    return served


@serve_version.on_rollback
def _unserve(txn) -> None:
    params = txn.get("params")
    engine_for(params.serving.backend, params).unserve(txn.get("served"))


@task(name="set-challenger-alias", cache_policy=NO_CACHE)
def set_challenger_alias(version: ModelVersion, params: Params, team: str = ORG) -> None:
    registry = Registry(params, team)
    previous = registry.aliased(CHALLENGER)
    txn = get_transaction()
    txn.set("params", params)
    txn.set("team", team)
    txn.set("previous_version", previous.version if previous else None)
    registry.set_alias(CHALLENGER, version.version)


@set_challenger_alias.on_rollback
def _restore_alias(txn) -> None:
    registry, previous = Registry(txn.get("params"), txn.get("team")), txn.get("previous_version")
    if previous is None:
        registry.delete_alias(CHALLENGER)
    else:
        registry.set_alias(CHALLENGER, previous)


@task(name="swap-arms", cache_policy=NO_CACHE)
def swap_arms(new_arms: list[Arm], params: Params, team: str = ORG) -> list[Arm]:
    """Replace `team`'s live arm set; returns the previous one (empty for a team that had none)."""
    with open_store(params.paths.database_url) as engine:
        previous = read_arms(engine, team)
        txn = get_transaction()
        txn.set("params", params)
        txn.set("team", team)
        txn.set("previous_arms", previous)
        replace_arms(engine, new_arms, team)
    return previous


@swap_arms.on_rollback
def _restore_arms(txn) -> None:
    with open_store(txn.get("params").paths.database_url) as engine:
        replace_arms(engine, txn.get("previous_arms"), txn.get("team"))


@task(name="check-arms", cache_policy=NO_CACHE)
def check_arms(expected: list[Arm], params: Params, team: str = ORG) -> None:
    with open_store(params.paths.database_url) as engine:
        live = read_arms(engine, team)
    if sorted(live, key=lambda a: a.name) != sorted(expected, key=lambda a: a.name):
        raise DeployError(f"arms read back differ from those written: {live} != {expected}")


def rollout(
    version: ModelVersion, model_dir: str, params: Params, base_dir: str | None = None, team: str = ORG
) -> Rollout:
    """Make version `team`'s challenger with deploy.challenger_share of its traffic; all or nothing. base_dir: the
    base checkpoint of an adapter version.

    Call inside a Prefect flow (the tasks and the transaction need a flow run context)."""
    with open_store(params.paths.database_url) as engine:
        live = read_arms(engine, team) or read_arms(engine)  # a team without arms starts from the organisation's
    with transaction():
        served = serve_version(version, model_dir, base_dir, params)
        new_arms = challenger_arms(live, version, served, params, team)
        set_challenger_alias(version, params, team)
        previous = swap_arms(new_arms, params, team)
        check_arms(new_arms, params, team)
    retire([a for a in previous if a not in new_arms], params)
    return Rollout(version=version, arms=new_arms, previous_arms=previous, served=served)


def retire(removed: list[Arm], params: Params) -> list[str]:
    """Free what arms no longer served held, unless a live arm of any team still uses it: each arm's engine retires
    it (a vLLM adapter unloaded, a full-weight vLLM server stopped; embedded arms hold nothing here). What was freed,
    in words."""
    with open_store(params.paths.database_url) as engine:
        live = read_arms(engine, None)
    freed = [line for arm in removed if (line := engine_for(arm.backend, params).retire(arm, live)) is not None]
    for line in freed:
        log.info(line)
    return freed
