"""Offline GRPO (RLinf's check): G samples per FIM train prompt, scored by the simulated user's rule.

The result is an ordinary rewarded snapshot (tasks/core/schema.py REWARDED_SCHEMA), so the same job
and the same loss train on it (`tasks/train/ppo.py`). Completions are sampled at the serving
temperature; the reward is the noise-free accept rule (`tasks.sim.users.is_right`, K of the most
common persona) with params.reward's values; the advantage is the reward normalised within its
group. Groups whose G rewards are all equal carry no signal and are dropped (DAPO's filter).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from tasks.core.config import Params
from tasks.core.generate import generate, load_model
from tasks.core.outcomes import reward_of
from tasks.core.schema import sampled_row, write_rewarded
from tasks.sim.users import is_right


def score(text: str, middle: str, params: Params) -> tuple[str, float]:
    """(outcome, reward) of one suggestion under the noise-free simulated user."""
    k = max(params.simulator.personas, key=lambda p: p.weight).min_accept_chars
    outcome = "abstained" if not text.strip() else "accepted" if is_right(text, middle, k) else "rejected"
    return outcome, reward_of(outcome, params.reward)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / std within one group (population std; all-equal groups give zeros)."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


def grpo_snapshot(from_dir: str | Path, samples: Sequence[dict], params: Params, out_path: str | Path) -> dict:
    """Sample G completions for each of the first train.grpo_prompts samples, score, normalise, write Parquet."""
    lm = load_model(from_dir)
    g = params.train.group_size
    samples = list(samples)[: params.train.grpo_prompts]
    rows, kept_groups, rewards_all = [], 0, []
    for n, sample in enumerate(tqdm(samples, desc=f"grpo: {g} samples per prompt", unit="prompt")):
        prompt = lm.template.render(sample["prefix"], sample["suffix"])
        gens = generate(
            *lm,
            [prompt] * g,
            params.serving.max_tokens,
            temperature=params.serving.temperature,
            top_p=params.serving.top_p,
            seed=params.train.seed * 1_000_003 + n,
        )
        scored = [score(gen.text, sample["middle"], params) for gen in gens]
        rewards = [r for _, r in scored]
        rewards_all.extend(rewards)
        if len(set(rewards)) < 2:
            continue
        kept_groups += 1
        for gen, (outcome, reward), adv in zip(gens, scored, group_advantages(rewards), strict=True):
            rows.append(
                sampled_row(
                    user_id="grpo",
                    arm="grpo",
                    model_version=str(from_dir),
                    prompt=prompt,
                    completion=gen.text,
                    token_ids=gen.token_ids,
                    logprobs=gen.logprobs,
                    temperature=params.serving.temperature,
                    outcome=outcome,
                    reward=reward,
                    advantage=adv,
                )
            )
    write_rewarded(rows, out_path)
    return {
        "prompts": len(samples),
        "groups_kept": kept_groups,
        "rows": len(rows),
        "mean_reward": statistics.fmean(rewards_all) if rewards_all else 0.0,
    }
