"""Held-out simulated acceptance of one model, in process: the number `make demo` prints first.

Generates for held-out FIM test samples (greedy, batched) and replays them to simulated users.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from serving.simulator import Summary, make_users, replay, summarise
from tasks.config import Params
from tasks.fim import build_prompt
from tasks.generate import generate, load_model


@dataclass(frozen=True)
class AcceptanceResult:
    summary: Summary
    suggestions: list[str]
    outcomes: list[str]


def complete_samples(model, tokenizer, samples: Sequence[dict], max_new_tokens: int, batch_size: int,
                     temperature: float = 0.0, seed: int = 0, desc: str = "generate") -> list[str]:
    """Suggestions for FIM samples, batched, with a progress bar."""
    suggestions: list[str] = []
    for start in tqdm(range(0, len(samples), batch_size), desc=desc, unit="batch"):
        chunk = samples[start:start + batch_size]
        prompts = [build_prompt(s["prefix"], s["suffix"]) for s in chunk]
        gens = generate(model, tokenizer, prompts, max_new_tokens, temperature=temperature, seed=seed + start)
        suggestions.extend(g.text for g in gens)
    return suggestions


def acceptance(model_dir: str | Path, samples: Sequence[dict], params: Params, n_users: int = 16) -> AcceptanceResult:
    model, tokenizer = load_model(model_dir)
    samples = list(samples)[: params.evaluate.n_samples]
    suggestions = complete_samples(model, tokenizer, samples, params.evaluate.max_new_tokens, params.evaluate.batch_size)
    users = make_users(n_users, params.simulator)
    outcomes = replay(samples, suggestions, users, params.simulator.seed)
    return AcceptanceResult(summarise(outcomes, suggestions), suggestions, outcomes)
