"""Roll a gated candidate out as the challenger, reversibly, in one Prefect transaction.

    champion arm (share 1 - s) + challenger arm (share s = deploy.challenger_share)

Steps, each a task whose `on_rollback` hook undoes it when a later step fails:

1. `start_arm_server`: embedded arms need nothing (gateways load the new checkpoint lazily on the
   next request after they see the new arm set); vLLM arms start a `vllm serve` process for the new
   version on a free port and wait for its health check (blue/green: the old process keeps serving
   until the arms switch). Rollback stops the new process.
2. `set_challenger_alias`: MLflow alias `challenger` -> the new version. Rollback restores the
   previous alias (or deletes it).
3. `swap_arms`: the live arm set in the log store, in one database transaction. Rollback restores
   the previous arm set.
4. `check_arms`: the live arm set reads back as written (a failure here, or anywhere inside the
   transaction, undoes 1-3).

The in-place alternative for vLLM (no second process): vLLM's dev-mode `collective_rpc`
`reload_weights` + `/reset_prefix_cache`, or a runtime LoRA adapter; both skip the health-checked
switch, so blue/green is the default here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import get_transaction, transaction

from serving.store import CHALLENGER, CHAMPION, Arm, init_schema, make_engine, read_arms, replace_arms
from tasks.config import Params
from tasks.deploy.errors import DeployError
from tasks.deploy.registry import ModelVersion, delete_alias, get_alias_version, set_alias
from tasks.deploy.vllm_server import start_vllm, stop_vllm, stop_vllm_at


@dataclass(frozen=True)
class Rollout:
    version: ModelVersion
    arms: list[Arm]  # live after the rollout
    previous_arms: list[Arm]


def challenger_arms(live: list[Arm], version: ModelVersion, model_uri: str, params: Params) -> list[Arm]:
    """The champion at 1 - share plus the new challenger at share (any earlier challenger is replaced)."""
    champion = next((a for a in live if a.name == CHAMPION), None)
    if champion is None:
        raise DeployError(
            f"no live '{CHAMPION}' arm to roll out beside (arms: {[a.name for a in live]}); "
            "start the gateway with `tabrl serve --model DIR` first"
        )
    share = params.deploy.challenger_share
    return [
        replace(champion, share=1.0 - share),
        Arm(CHALLENGER, version.label, model_uri, params.serving.backend, share),
    ]


def _engine(params: Params):
    engine = make_engine(params.paths.database_url)
    init_schema(engine)
    return engine


@task(name="start-arm-server", cache_policy=NO_CACHE)
def start_arm_server(model_dir: str, params: Params) -> str:
    """The arm's model_uri: the checkpoint dir (embedded) or a fresh, healthy vLLM server's URL."""
    if params.serving.backend == "embedded":
        return model_dir
    server = start_vllm(model_dir, params)
    get_transaction().set("vllm_pid", server.pid)
    return server.url


@start_arm_server.on_rollback
def _stop_new_server(txn) -> None:
    pid = txn.get("vllm_pid", None)
    if pid is not None:
        stop_vllm(pid)


@task(name="set-challenger-alias", cache_policy=NO_CACHE)
def set_challenger_alias(version: ModelVersion, params: Params) -> None:
    previous = get_alias_version(params, CHALLENGER)
    txn = get_transaction()
    txn.set("params", params)
    txn.set("previous_version", previous.version if previous else None)
    set_alias(params, CHALLENGER, version.version)


@set_challenger_alias.on_rollback
def _restore_alias(txn) -> None:
    params, previous = txn.get("params"), txn.get("previous_version")
    if previous is None:
        delete_alias(params, CHALLENGER)
    else:
        set_alias(params, CHALLENGER, previous)


@task(name="swap-arms", cache_policy=NO_CACHE)
def swap_arms(new_arms: list[Arm], params: Params) -> list[Arm]:
    """Replace the live arm set; returns the previous one."""
    engine = _engine(params)
    try:
        previous = read_arms(engine)
        txn = get_transaction()
        txn.set("params", params)
        txn.set("previous_arms", previous)
        replace_arms(engine, new_arms)
    finally:
        engine.dispose()
    return previous


@swap_arms.on_rollback
def _restore_arms(txn) -> None:
    engine = _engine(txn.get("params"))
    try:
        replace_arms(engine, txn.get("previous_arms"))
    finally:
        engine.dispose()


@task(name="check-arms", cache_policy=NO_CACHE)
def check_arms(expected: list[Arm], params: Params) -> None:
    engine = _engine(params)
    try:
        live = read_arms(engine)
    finally:
        engine.dispose()
    if sorted(live, key=lambda a: a.name) != sorted(expected, key=lambda a: a.name):
        raise DeployError(f"arms read back differ from those written: {live} != {expected}")


def rollout(version: ModelVersion, model_dir: str, params: Params) -> Rollout:
    """Make version the challenger with deploy.challenger_share of traffic; all or nothing.

    Call inside a Prefect flow (the tasks and the transaction need a flow run context)."""
    engine = _engine(params)
    try:
        live = read_arms(engine)
    finally:
        engine.dispose()
    with transaction():
        model_uri = start_arm_server(model_dir, params)
        new_arms = challenger_arms(live, version, model_uri, params)
        set_challenger_alias(version, params)
        previous = swap_arms(new_arms, params)
        check_arms(new_arms, params)
    old_servers = [a for a in previous if a.backend == "vllm" and a.model_uri not in {x.model_uri for x in new_arms}]
    for arm in old_servers:  # blue/green: the old challenger's server goes once the new arms are live
        stop_vllm_at(arm.model_uri, params)
    return Rollout(version=version, arms=new_arms, previous_arms=previous)
