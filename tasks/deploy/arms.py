"""The champion's arm on the serving engine, and the arms table as the truth of what the engines serve.

* ``serve_champion``: the registry's champion (the base model, version 1, on a fresh registry) made
  the only arm, served by serving.backend's engine: on vLLM its base's one LoRA server is found or
  started, an adapter champion is loaded onto it, and the arm asks for the model by its name there;
  embedded, the arm names the checkpoint (and adapter). `tabrl vllm start` and the online loop call it.
* ``sync_adapters``: every live arm's engine serves again what the arm names and the engine lost (a
  restart empties vLLM's runtime adapters). The gateway does the same lazily on a request that meets
  an unknown adapter; `tabrl vllm sync` and each A/B decision do it eagerly.
"""

from __future__ import annotations

import logging

from tasks.core.config import Params
from tasks.core.engines import engine_for
from tasks.core.store import CHAMPION, Arm, open_store, read_arms, replace_arms
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry

log = logging.getLogger(__name__)


def serve_champion(params: Params) -> Arm:
    """Make the registry's champion the one live arm on serving.backend, started where needed (see above); raises
    `tasks.core.engines.base.ServeError` when the engine cannot serve it."""
    registry = Registry(params)
    champion = registry.ensure_champion(params.model.base_dir)
    champion_dir = resolve_model_dir(champion.uri, params)
    base_dir = resolve_model_dir(registry.base_of(champion).uri, params)
    engine = engine_for(params.serving.backend, params)
    served = engine.serve_champion(champion.label, str(champion_dir), str(base_dir))
    arm = Arm(CHAMPION, champion.label, served.model_uri, engine.name, 1.0, served.served_model, served.adapter)
    with open_store(params.paths.database_url) as store:
        replace_arms(store, [arm])
    return arm


def sync_adapters(params: Params) -> list[str]:
    """Serve again, on each live arm's engine (every team's), what the arm names and the engine lost; what was
    loaded."""
    with open_store(params.paths.database_url) as engine:
        arms = read_arms(engine, None)
    loaded = [line for arm in arms if (line := engine_for(arm.backend, params).resync(arm)) is not None]
    for line in loaded:
        log.info("loaded again: %s", line)
    return loaded
