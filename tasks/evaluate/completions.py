"""The judge's FIM samples completed by a model, remembered per model, so no gate completes them twice.

Every gate completes the same held-out FIM samples (the first evaluate.n_samples) with the candidate and the
champion, greedily; from the second cycle on the champion is the last gate's candidate, whose completions that
gate already made. `fim_completions` keeps each model's in a diskcache (SQLite underneath, safe across
processes) under paths.state_dir, keyed by what decides a greedy completion:

* the model's identity: a checkpoint's weights (`checkpoint_sha256`), or an adapter's files and its base's;
* the engine: serving.backend, vLLM's arguments (its dtype), and for an adapter whether it runs merged;
* evaluate.max_new_tokens and the FIM template;
* the prompt, rendered as the engine sees it.

A greedy completion can differ in the last bits between batches on vLLM; a remembered one is one the model
made. evaluate.completion_cache: false completes every sample every time.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from diskcache import Cache

from tasks.core.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, checkpoint_sha256, file_sha256, is_adapter, read_base
from tasks.core.config import Params
from tasks.core.engines import engine_for
from tasks.core.inference import Engine
from tasks.sim.acceptance import complete_samples, render_request

CACHE_DIR = "completion_cache"  # a diskcache directory under paths.state_dir


def model_identity(model_dir: str | Path) -> str:
    """What makes a model that model: a checkpoint's weights, or an adapter's config and weights and its base's."""
    model_dir = Path(model_dir)
    if not is_adapter(model_dir):
        return checkpoint_sha256(model_dir)
    files = [file_sha256(model_dir / ADAPTER_CONFIG), file_sha256(model_dir / ADAPTER_WEIGHTS)]
    parts = [*files, read_base(model_dir).sha256]
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


def model_key(model_dir: str | Path, engine: Engine, params: Params) -> str:
    """The key of a model's greedy FIM completions on this engine (see the module docstring)."""
    spec = {
        "model": model_identity(model_dir),
        **engine_for(params.serving.backend, params).identity(is_adapter(model_dir)),
        "max_new_tokens": params.evaluate.max_new_tokens,
        "template": asdict(engine.template),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def fim_completions(
    engine: Engine, model_dir: str | Path, samples: Sequence[dict], params: Params, desc: str = "generate"
) -> tuple[list[str], float]:
    """Greedy completions of the samples by the engine's model (model_dir), those it made before remembered, and
    the generation wall time per sample (a remembered one's from the call that made it)."""
    if not params.evaluate.completion_cache:
        return _complete_timed(engine, samples, params, desc)
    shas = [hashlib.sha256(render_request(engine.template, s, params.serving).encode()).hexdigest() for s in samples]
    key = model_key(model_dir, engine, params)
    with Cache(str(Path(params.paths.state_dir) / CACHE_DIR)) as cache:  # SQLite-backed, safe across processes
        known = {sha: found for sha in shas if (found := cache.get(f"{key}:{sha}")) is not None}
        missing = [i for i, sha in enumerate(shas) if sha not in known]
        if missing:
            texts, ms = _complete_timed(engine, [samples[i] for i in missing], params, desc)
            for i, text in zip(missing, texts, strict=True):
                known[shas[i]] = cache[f"{key}:{shas[i]}"] = (text, ms)
    return [known[sha][0] for sha in shas], sum(known[sha][1] for sha in shas) / max(len(shas), 1)


def _complete_timed(engine: Engine, samples: Sequence[dict], params: Params, desc: str) -> tuple[list[str], float]:
    """The samples' greedy completions and the generation wall time per sample."""
    started = time.perf_counter()
    texts = complete_samples(engine, samples, params, desc=desc)
    return texts, (time.perf_counter() - started) * 1000.0 / max(len(samples), 1)
