"""bench.learning's run key: what a stored (setting, seed) result depends on, so a later invocation reuses it."""

from __future__ import annotations

import json
from pathlib import Path


def computed_dtypes(params) -> dict[str, str | None]:
    """What training and vLLM compute in on this machine: `host` (the real-model overlays') resolves by its CPU,
    so runs stored on another machine under the same params may have computed in another dtype."""
    import torch

    from tasks.core.dtypes import resolve_dtype
    from tasks.core.vllm import server_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"train": resolve_dtype(params.train.compute_dtype, device), "vllm": server_dtype(params.serving)}


# The params a run key is written against: every default as of 2026-12-03, before the code's defaults became
# params.yaml's (issue 55); keys computed since against the moving defaults (exclude_defaults) stay the same.
KEY_ORIGIN = Path(__file__).with_name("learning_key_origin.json")


def key_origin() -> dict:
    """KEY_ORIGIN's values, over today's defaults for a param added since."""
    from tasks.core.config import Params

    def merged(now: dict, then: dict) -> dict:
        return {
            k: merged(v, then[k]) if isinstance(v, dict) and isinstance(then.get(k), dict) else then.get(k, v)
            for k, v in now.items()
        }

    return merged(Params().model_dump(mode="json"), json.loads(KEY_ORIGIN.read_text()))


def differences(values: dict, origin: dict, section) -> dict:
    """values' entries that differ from origin's, section by section, as pydantic's exclude_defaults writes a
    dump's differences from the defaults (a section that differs nowhere is left out)."""
    from tasks.core.config import Section

    out = {}
    for name, value in values.items():
        kind = section.model_fields[name].annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            if inner := differences(value, origin[name], kind):
                out[name] = inner
        elif value != origin[name]:
            out[name] = value
    return out


EDITOR_KEYS = ("client", "debounce_s", "pause_sigma", "min_display_s")  # simulator params of the editor's pace


def run_key(params, args) -> str:
    """What a stored (setting, seed) result depends on: the resolved params, written as their differences from
    KEY_ORIGIN (the defaults when runs were first stored; a param added since counts from its own default), so
    that moving a default changes no run's key, and a param added later at a default that keeps today's behaviour
    leaves stored runs valid, as in a run that spans sessions with its runs/*.json carried over. Less where files
    go and where vLLM is installed; with the training and vLLM dtypes as this machine resolves them, and the loop's
    size. Not the final evaluation's size: a stored run's final models are typed again when --final-requests
    changes (None holds its place, where the keys of runs stored before had it)."""
    import hashlib

    from tasks.core.adapters import checkpoint_sha256

    body = differences(params.model_dump(mode="json"), key_origin(), type(params))
    body.pop("paths", None)
    body.get("evaluate", {}).get("judge", {}).pop("cache_path", None)
    body.get("serving", {}).pop("vllm_python", None)  # where vLLM is installed, as paths are where files go
    # the dtypes as computed, not as written: `host` on a CPU without bf16 units is the run of an explicit float32
    body.get("train", {}).pop("compute_dtype", None)
    body.get("serving", {}).pop("vllm_dtype", None)
    body["dtypes"] = computed_dtypes(params)
    # How the simulated editors treat answers: in full when they act as Continue does (cancel, discard), and
    # nothing when they wait for every answer, as every run stored before 2026-12-02 did: those keep their keys.
    simulator = body.get("simulator", {})
    for name in EDITOR_KEYS:
        simulator.pop(name, None)
    if not simulator:
        body.pop("simulator", None)
    if params.simulator.client != "waits":
        editor = params.simulator.model_dump(mode="json", include=set(EDITOR_KEYS))
        body["editor"] = editor | {"pause_s": [persona.pause_s for persona in params.simulator.personas]}
    body.setdefault("model", {})
    body["model"]["base_dir"] = checkpoint_sha256(params.model.base_dir)
    body["loop"] = [args.cycles, args.requests, args.users, str(args.corpus), None, "editor traffic"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
