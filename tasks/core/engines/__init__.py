"""The serving engines, one module per backend, chosen once by name (serving.backend, or a live arm's backend).

    engine = engine_for(params.serving.backend, params)
    served = engine.serve(version.label, model_dir, base_dir)      # before any user is routed to it
    with engine.evaluation(model_dir, base_dir) as typing:          # a gate's, `tabrl acceptance`'s
        gens = typing.complete(prompts, max_new_tokens=48)

`ENGINES` is the registry: a name (a `tasks.core.config.BackendName`) and the class that serves it
(`tasks.core.engines.base.ServingEngine`). Nothing outside these modules asks which backend it runs on: it asks
the engine. Adding one is a module here and an entry in each of the two (docs/how-to/serving-engine.md).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tasks.core.config import BACKENDS, Params
from tasks.core.engines.base import Backend, ServingEngine
from tasks.core.engines.embedded import Embedded
from tasks.core.engines.vllm import Vllm
from tasks.core.inference import Engine
from tasks.core.store import Arm

ENGINES: dict[str, type[ServingEngine]] = {"embedded": Embedded, "vllm": Vllm}


def engine_class(name: str) -> type[ServingEngine]:
    """The engine registered under name; ValueError naming the registered ones when there is none."""
    if name not in ENGINES:
        raise ValueError(f"no serving engine {name!r}: registered are {', '.join(ENGINES)} (config: {BACKENDS})")
    return ENGINES[name]


def engine_for(name: str, params: Params) -> ServingEngine:
    """The engine `name` under the run's params."""
    return engine_class(name)(params)


def make_backend(arm: Arm, timeout_s: float) -> Backend:
    """How the gateway generates for an arm: its engine's backend (the arm's model_uri is a checkpoint dir, or a
    server URL asked for the arm's served model)."""
    return engine_class(arm.backend).backend(arm, timeout_s)


def open_engine(
    model_dir: str | Path, params: Params, base_dir: str | Path | None = None
) -> contextlib.AbstractContextManager[Engine]:
    """The engine that completes prompts for model_dir (a checkpoint, or an adapter on base_dir) under params: the
    serving.backend engine's evaluation; anything it loaded or started for it is freed when the block ends."""
    return engine_for(params.serving.backend, params).evaluation(Path(model_dir), base_dir)
