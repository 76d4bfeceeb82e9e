"""The champion's arm on the serving engine, and the arms table as the truth of what vLLM serves.

* ``serve_champion``: the registry's champion (the base model, version 1, on a fresh registry) made
  the only arm: on vLLM its base's one LoRA server is found or started, an adapter champion is
  loaded onto it, and the arm asks for the model by its name there; embedded, the arm names the
  checkpoint (and adapter). `tabrl vllm start` and the online loop call it.
* ``sync_adapters``: every live vLLM arm's adapter loaded on its server, again where the server lost
  it (a restart empties vLLM's runtime adapters). The gateway does the same lazily on a request
  that meets an unknown adapter; `tabrl vllm sync` and each A/B decision do it eagerly.
"""

from __future__ import annotations

import logging

from tasks.core.adapters import is_adapter
from tasks.core.config import Params
from tasks.core.store import CHAMPION, Arm, open_store, read_arms, replace_arms
from tasks.core.vllm import adapter_name, base_server, load_adapter, served_models
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry

log = logging.getLogger(__name__)


def serve_champion(params: Params) -> Arm:
    """Make the registry's champion the one live arm on serving.backend, started where needed (see above)."""
    registry = Registry(params)
    champion = registry.ensure_champion(params.model.base_dir)
    champion_dir = resolve_model_dir(champion.uri, params)
    base_dir = resolve_model_dir(registry.base_of(champion).uri, params)
    adapter = str(champion_dir) if is_adapter(champion_dir) else None
    name = adapter_name(champion.label) if adapter is not None else None
    if params.serving.backend == "embedded":
        arm = Arm(CHAMPION, champion.label, str(base_dir), "embedded", 1.0, name, adapter)
    else:
        server = base_server(base_dir, params)
        if adapter is not None:
            load_adapter(server.url, name, adapter)
        arm = Arm(CHAMPION, champion.label, server.url, "vllm", 1.0, name or server.model_dir, adapter)
    with open_store(params.paths.database_url) as engine:
        replace_arms(engine, [arm])
    return arm


def sync_adapters(params: Params) -> list[str]:
    """Load every live vLLM arm's adapter that its server does not hold (under the arm's name); what was loaded."""
    with open_store(params.paths.database_url) as engine:
        arms = read_arms(engine)
    loaded = []
    for arm in arms:
        if arm.backend != "vllm" or arm.adapter is None or arm.served_model is None:
            continue
        if arm.served_model not in served_models(arm.model_uri):
            load_adapter(arm.model_uri, arm.served_model, arm.adapter)
            loaded.append(f"{arm.name}: {arm.model_version} as {arm.served_model} on {arm.model_uri}")
            log.info("loaded again: %s", loaded[-1])
    return loaded
