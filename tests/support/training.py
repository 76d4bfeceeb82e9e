"""Reward-labelled snapshots sampled from a model, for the training tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.core.generate import generate, load_model
from tasks.core.schema import REWARDED_SCHEMA


def rewarded_row(prompt, text, ids, logps, advantage, temperature, outcome="rejected") -> dict:
    """One row of a rewarded snapshot as the reward stage writes it (reward = advantage: raw advantages)."""
    return {
        "completion_id": f"c{random.random()}",
        "created_at": 0.0,
        "user_id": "u",
        "arm": "champion",
        "model_version": "v0",
        "prompt": prompt,
        "completion": text,
        "token_ids": ids,
        "logprobs": logps,
        "temperature": temperature,
        "outcome": outcome,
        "accepted_chars": None,
        "reward": advantage,
        "advantage": advantage,
    }


def sampled_snapshot(
    model_dir: Path, samples: Sequence[dict], path: Path, max_new: int, temperature: float, seed: int = 0
) -> Path:
    """Completions the model samples for the samples' FIM prompts (in its own template, short), each rewarded
    +0.75 or -0.25 at random, written as a rewarded snapshot at path."""
    model, tok, template = load_model(model_dir)
    prompts = [template.render(s["prefix"][-300:], s["suffix"][:60]) for s in samples]
    gens = generate(model, tok, template, prompts, max_new, temperature=temperature, seed=seed)
    rng = random.Random(seed)
    rows = [
        rewarded_row(p, g.text, g.token_ids, g.logprobs, rng.choice([0.75, -0.25]), temperature)
        for p, g in zip(prompts, gens, strict=True)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), path)
    return path
