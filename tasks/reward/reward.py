"""Reward: outcome -> reward -> advantage, and the cycle's per-arm summary.

Rewards are Cursor Tab RL's (params ``reward``): accepted +0.75, rejected -0.25, nothing shown 0; with
``reward.accepted_per_char`` an accepted suggestion earns that much more per character it saved.
Each logged suggestion is one step of a one-step episode, so its Monte-Carlo return is its reward.
Advantages (``reward.advantage``), computed over the whole snapshot (the cycle is the batch):

    raw         A = r                          (the one-step return, as in RLinf)
    batch_mean  A = r - mean(r)                (a constant baseline)
    batch_norm  A = (r - mean(r)) / std(r)     (whitened, as REINFORCE++ with one sample per prompt;
                                                all-equal rewards carry no signal -> A = 0)
    shown_mean  A = r - mean(r over shown)     (the baseline of the rows that carry gradient: a shown
                                                suggestion's tokens; nothing-shown rows get A = 0)

Why shown_mean: only shown suggestions have tokens to train, and at the accept rates of a weak model
(~10 % of shown) raw rewards push nine rejected rows down for each accepted one pushed up, so every
shown token loses probability and the model mostly learns to show less. Against the shown rows' own
mean, accepted and rejected rows pull with equal total weight (0.9 each way at 10 %): what moves is
which suggestions the model is sure of, not how often it is sure.

The rewarded snapshot has ``tasks.core.schema.REWARDED_SCHEMA``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.core.config import RewardParams
from tasks.core.outcomes import OUTCOMES, reward_of, reward_per_request, taken_chars
from tasks.core.schema import REWARDED_SCHEMA
from tasks.reward.typed import continuations
from tasks.sim.users import Summary, summarise

STD_EPS = 1e-8  # keeps whitening finite; far below any reward spread that carries signal


def raw(rewards: np.ndarray, shown: np.ndarray) -> np.ndarray:
    return rewards.astype(np.float64)


def batch_mean(rewards: np.ndarray, shown: np.ndarray) -> np.ndarray:
    return rewards - rewards.mean() if rewards.size else rewards.astype(np.float64)


def batch_norm(rewards: np.ndarray, shown: np.ndarray) -> np.ndarray:
    centred = batch_mean(rewards, shown)
    std = rewards.std() if rewards.size else 0.0
    return centred / (std + STD_EPS) if std > STD_EPS else np.zeros_like(centred)


def shown_mean(rewards: np.ndarray, shown: np.ndarray) -> np.ndarray:
    out = np.zeros_like(rewards, dtype=np.float64)
    if shown.any():
        out[shown] = rewards[shown] - rewards[shown].mean()
    return out


# reward.advantage -> A(rewards, shown): shown marks the rows whose suggestion was shown (not abstained)
ADVANTAGES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "raw": raw,
    "batch_mean": batch_mean,
    "batch_norm": batch_norm,
    "shown_mean": shown_mean,
}


def add_continuations(table: pa.Table, params: RewardParams) -> pa.Table:
    """The snapshot with a ``continuation`` column: what each user typed next (tasks/reward/typed.py)."""
    for name in ("prefix", "suffix"):  # snapshots written before the editor's texts were logged
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, pa.string()))
    typed = continuations(
        table.column("user_id").to_pylist(),
        table.column("prefix").to_pylist(),
        table.column("suffix").to_pylist(),
        params.continuation_chars,
    )
    return table.append_column("continuation", pa.array(typed, pa.string()))


def add_rewards(table: pa.Table, params: RewardParams) -> pa.Table:
    """An interaction snapshot with ``continuation``, ``reward`` and ``advantage`` columns (REWARDED_SCHEMA)."""
    table = add_continuations(table, params)
    by_outcome = {outcome: reward_of(outcome, params) for outcome in OUTCOMES}
    outcomes = table.column("outcome").to_pylist()
    rewards = np.array([by_outcome[o] if o in by_outcome else reward_of(o, params) for o in outcomes], dtype=np.float64)
    if params.accepted_per_char:
        chars = np.array([len(c) for c in table.column("completion").to_pylist()], dtype=np.float64)
        rewards += params.accepted_per_char * chars * np.array([o == "accepted" for o in outcomes])
    shown = np.array([o != "abstained" for o in outcomes], dtype=bool)
    advantages = ADVANTAGES[params.advantage](rewards, shown)
    return (
        table.append_column("reward", pa.array(rewards, pa.float64()))
        .append_column("advantage", pa.array(advantages, pa.float64()))
        .select(REWARDED_SCHEMA.names)
        .cast(REWARDED_SCHEMA)
    )


@dataclass(frozen=True)
class RewardResult:
    path: Path
    rows: int
    reward_mean: float
    advantage_mean: float
    advantage_std: float
    continued: int  # rows whose continuation (what the user typed next) is known
    summary: dict[str, dict[str, float]]  # per arm and "all" (see arm_summary)


def reward_snapshot(
    snapshot: Path, params: RewardParams, out: Path, arms: dict[str, Summary] | None = None
) -> RewardResult:
    """Read an interaction snapshot, add rewards and advantages, write it to ``out``.

    The summary counts the snapshot's rows, or ``arms`` when given: pass the ingest's
    ``IngestResult.arms`` to count every decided outcome of the cycle (cleaned-out rows included).
    """
    table = add_rewards(pq.read_table(snapshot), params)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, compression="zstd")
    rewards, adv = table.column("reward").to_numpy(), table.column("advantage").to_numpy()
    summaries = arms if arms is not None else _by_arm(table)
    return RewardResult(
        path=out,
        rows=table.num_rows,
        reward_mean=float(rewards.mean()) if rewards.size else 0.0,
        advantage_mean=float(adv.mean()) if adv.size else 0.0,
        advantage_std=float(adv.std()) if adv.size else 0.0,
        continued=table.num_rows - table.column("continuation").null_count,
        summary=cycle_summary(summaries, params),
    )


def _by_arm(table: pa.Table) -> dict[str, Summary]:
    """The snapshot's counts by arm and "all" (accepted characters as the client reported them)."""
    groups: dict[str, tuple[list[str], list[str], list[int]]] = {"all": ([], [], [])}
    for arm, outcome, completion, reported in zip(
        table.column("arm").to_pylist(),
        table.column("outcome").to_pylist(),
        table.column("completion").to_pylist(),
        table.column("accepted_chars").to_pylist(),
        strict=True,
    ):
        for key in ("all", arm):
            outcomes, suggestions, taken = groups.setdefault(key, ([], [], []))
            outcomes.append(outcome)
            suggestions.append(completion)
            taken.append(taken_chars(outcome, completion, reported))
    return {
        arm: replace(summarise(outcomes, suggestions), accepted_chars=sum(taken))
        for arm, (outcomes, suggestions, taken) in groups.items()
    }


def arm_summary(s: Summary, params: RewardParams) -> dict[str, float]:
    return {
        "requests": s.requests,
        "suggest_rate": s.suggest_rate,
        "accept_rate": s.accept_rate,
        "reward_per_request": reward_per_request(s, params),
    }


def cycle_summary(arms: dict[str, Summary], params: RewardParams) -> dict[str, dict[str, float]]:
    """Per arm (and "all"): requests, suggestion rate, accept rate per shown suggestion, reward per request."""
    return {arm: arm_summary(s, params) for arm, s in arms.items()}


def reward_metrics(result: RewardResult) -> dict[str, float]:
    """Namespaced numbers for MLflow: ``reward/accept_rate`` (all arms), ``reward/<arm>/accept_rate``, ..."""
    metrics = {
        "reward/rows": result.rows,
        "reward/mean": result.reward_mean,
        "reward/advantage_std": result.advantage_std,
        "reward/continued": result.continued,
    }
    for arm, numbers in result.summary.items():
        prefix = "reward/" if arm == "all" else f"reward/{arm}/"
        metrics.update({prefix + key: value for key, value in numbers.items()})
    return {key: float(value) for key, value in metrics.items()}
