"""Roll a gated candidate out as the challenger, reversibly, in one Prefect transaction.

    champion arm (share 1 - s) + challenger arm (share s = deploy.challenger_share)

Steps, each a task whose `on_rollback` hook undoes it when a later step fails:

1. `serve_version`: where the new version will be served, made ready before any user is routed to it.
   * a LoRA adapter on a vLLM arm (serving.adapter_serving: lora): the base's one server (started
     once, `tasks/core/vllm.py`) loads it at runtime under a name never used before, then answers one
     probe request. Rollback unloads it. No new process: a version is live within a second.
   * a full checkpoint on a vLLM arm (or an adapter with adapter_serving: merged, merged first): a
     `vllm serve` process of its own on a free port, health-checked (blue/green: the old process
     keeps serving until the arms switch). Rollback stops it.
   * embedded arms: nothing to start (gateways load the checkpoint, or the adapter onto the shared
     base, on the next request after they see the new arms); an adapter's base is checked here.
2. `set_challenger_alias`: MLflow alias `challenger` -> the new version. Rollback restores the
   previous alias (or deletes it).
3. `swap_arms`: the live arm set in the log store, in one database transaction. Rollback restores
   the previous arm set.
4. `check_arms`: the live arm set reads back as written (a failure here, or anywhere inside the
   transaction, undoes 1-3).

After the switch, what the previous challenger held is retired (`retire`: its adapter unloaded, or
its server stopped), as promote and rollback do for the arms they remove.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import get_transaction, transaction

from tasks.core.adapters import AdapterBaseError, check_base, is_adapter
from tasks.core.config import Params
from tasks.core.generate import merged_dir, save_merged
from tasks.core.store import CHALLENGER, CHAMPION, Arm, open_store, read_arms, replace_arms
from tasks.core.vllm import (
    VllmError,
    adapter_name,
    base_server,
    load_adapter,
    probe,
    start_vllm,
    stop_vllm,
    stop_vllm_at,
    unload_adapter,
)
from tasks.deploy.errors import DeployError
from tasks.deploy.registry import Registry
from tasks.deploy.versions import ModelVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """Where a version is served: what its arm records."""

    model_uri: str  # checkpoint dir (embedded; an adapter's base) or the vLLM server's URL
    served_model: str | None = None  # the adapter's load name (None: the server's or directory's one model)
    adapter: str | None = None  # the adapter directory on model_uri's base (None: a full checkpoint)
    seconds: float = 0.0  # from "start serving it" to "it answered" (load + probe, or process start + health)


@dataclass(frozen=True)
class Rollout:
    version: ModelVersion
    arms: list[Arm]  # live after the rollout
    previous_arms: list[Arm]
    served: Served


def challenger_arms(live: list[Arm], version: ModelVersion, served: Served, params: Params) -> list[Arm]:
    """The champion at 1 - share plus the new challenger at share (any earlier challenger is replaced)."""
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
    )
    return [replace(champion, share=1.0 - share), challenger]


@task(name="serve-version", cache_policy=NO_CACHE)
def serve_version(version: ModelVersion, model_dir: str, base_dir: str | None, params: Params) -> Served:
    """Make the version servable (see the module docstring) and say where; recorded for the rollback."""
    adapter = is_adapter(model_dir)
    if adapter and base_dir is None:
        raise DeployError(f"{version.label} is a LoRA adapter: its base checkpoint directory is needed to serve it")
    txn = get_transaction()
    try:
        if params.serving.backend == "embedded":
            if not adapter:
                return Served(model_dir)
            check_base(model_dir, base_dir, "serve")
            return Served(str(base_dir), adapter_name(version.label), model_dir)
        if adapter and params.serving.adapter_serving == "lora":
            server = base_server(base_dir, params)
            check_base(model_dir, server.model_dir, "serve")
            name = adapter_name(version.label)
            seconds = load_adapter(server.url, name, model_dir)
            txn.set("loaded_adapter", (server.url, name))
            seconds += _timed_probe(server.url, name)
            return Served(server.url, name, model_dir, seconds)
        if adapter:  # adapter_serving: merged
            model_dir = str(save_merged(model_dir, base_dir, merged_dir(model_dir, params.paths.models_dir)))
        server = start_vllm(model_dir, params)
        txn.set("vllm_pid", server.pid)
        return Served(server.url)
    except (VllmError, AdapterBaseError) as err:
        raise DeployError(f"cannot serve {version.label}: {err}") from err


def _timed_probe(url: str, name: str) -> float:
    started = time.perf_counter()
    probe(url, name)
    return time.perf_counter() - started


@serve_version.on_rollback
def _unserve(txn) -> None:
    pid = txn.get("vllm_pid", None)
    if pid is not None:
        stop_vllm(pid)
    loaded = txn.get("loaded_adapter", None)
    if loaded is not None:
        unload_adapter(*loaded)


@task(name="set-challenger-alias", cache_policy=NO_CACHE)
def set_challenger_alias(version: ModelVersion, params: Params) -> None:
    registry = Registry(params)
    previous = registry.aliased(CHALLENGER)
    txn = get_transaction()
    txn.set("params", params)
    txn.set("previous_version", previous.version if previous else None)
    registry.set_alias(CHALLENGER, version.version)


@set_challenger_alias.on_rollback
def _restore_alias(txn) -> None:
    registry, previous = Registry(txn.get("params")), txn.get("previous_version")
    if previous is None:
        registry.delete_alias(CHALLENGER)
    else:
        registry.set_alias(CHALLENGER, previous)


@task(name="swap-arms", cache_policy=NO_CACHE)
def swap_arms(new_arms: list[Arm], params: Params) -> list[Arm]:
    """Replace the live arm set; returns the previous one."""
    with open_store(params.paths.database_url) as engine:
        previous = read_arms(engine)
        txn = get_transaction()
        txn.set("params", params)
        txn.set("previous_arms", previous)
        replace_arms(engine, new_arms)
    return previous


@swap_arms.on_rollback
def _restore_arms(txn) -> None:
    with open_store(txn.get("params").paths.database_url) as engine:
        replace_arms(engine, txn.get("previous_arms"))


@task(name="check-arms", cache_policy=NO_CACHE)
def check_arms(expected: list[Arm], params: Params) -> None:
    with open_store(params.paths.database_url) as engine:
        live = read_arms(engine)
    if sorted(live, key=lambda a: a.name) != sorted(expected, key=lambda a: a.name):
        raise DeployError(f"arms read back differ from those written: {live} != {expected}")


def rollout(version: ModelVersion, model_dir: str, params: Params, base_dir: str | None = None) -> Rollout:
    """Make version the challenger with deploy.challenger_share of traffic; all or nothing. base_dir: the base
    checkpoint of an adapter version.

    Call inside a Prefect flow (the tasks and the transaction need a flow run context)."""
    with open_store(params.paths.database_url) as engine:
        live = read_arms(engine)
    with transaction():
        served = serve_version(version, model_dir, base_dir, params)
        new_arms = challenger_arms(live, version, served, params)
        set_challenger_alias(version, params)
        previous = swap_arms(new_arms, params)
        check_arms(new_arms, params)
    retire([a for a in previous if a not in new_arms], new_arms, params)
    return Rollout(version=version, arms=new_arms, previous_arms=previous, served=served)


def retire(removed: list[Arm], live: list[Arm], params: Params) -> list[str]:
    """Free what arms no longer served held, unless a live arm still uses it: a vLLM adapter is unloaded from its
    server, a full-weight vLLM server (blue/green) is stopped; a base server stays while any arm is on it. Embedded
    arms hold nothing here (each gateway drops a backend once no arm names it). Returns what was freed, in words.
    A server that is already gone is no error: what is retired is not served either way."""
    freed = []
    in_use = {(a.model_uri, a.served_model) for a in live}
    urls_in_use = {a.model_uri for a in live}
    for arm in removed:
        if arm.backend != "vllm" or (arm.model_uri, arm.served_model) in in_use:
            continue
        try:
            if arm.served_model is not None:
                if unload_adapter(arm.model_uri, arm.served_model):
                    freed.append(f"unloaded adapter {arm.served_model} ({arm.model_version}) from {arm.model_uri}")
            elif arm.model_uri not in urls_in_use and stop_vllm_at(arm.model_uri, params):
                freed.append(f"stopped the vLLM server of {arm.model_version} at {arm.model_uri}")
        except VllmError as err:
            log.warning("retiring %s: %s", arm.model_version, err)
    for line in freed:
        log.info(line)
    return freed
