"""95 % confidence intervals for editor-traffic metrics: a bootstrap over seeds and typing sessions.

Requests inside one typing session are not independent (the cursor jumps after a Tab, the same
line is asked about again), so the unit resampled is the session, and seeds are resampled above
it (hierarchical bootstrap). A session is a row of counts (``tasks.sim.acceptance.session_stats``):

    requests, shown, accepted, right, saved chars, typed chars

and every metric is a ratio of column sums, so it is computed on the resampled rows exactly as on
the data. ``interval`` gives one setting's CI; ``difference`` the CI of a - b and whether it
excludes 0: independent resamples of each setting, or, with ``paired=True``, the same resample for
both. Pairing is for two models typed through the same held-out regions by the same users with the
same noise draws (seed k of a and seed k of b, as bench/learning.py and the demo evaluate): what the
two share (which regions are easy, which wrong suggestions a persona's noise accepts) then cancels
in the difference instead of widening its interval (the paired bootstrap of MT evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.core.config import RewardParams
from tasks.core.outcomes import total_reward

REQ, SHOWN, ACC, RIGHT, SAVED, TYPED = range(6)
Sessions = Sequence[Sequence[Sequence[int]]]  # per seed: per session: the six counts


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros_like(num, dtype=float), where=den > 0)


def metric_fns(reward: RewardParams) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """Metric name -> function of column sums (..., 6) -> value (...)."""

    def reward_per_request(t: np.ndarray) -> np.ndarray:
        return _ratio(total_reward(t[..., REQ], t[..., SHOWN], t[..., ACC], reward), t[..., REQ])

    return {
        "suggest_rate": lambda t: _ratio(t[..., SHOWN], t[..., REQ]),
        "accept_rate": lambda t: _ratio(t[..., ACC], t[..., SHOWN]),
        "right_rate": lambda t: _ratio(t[..., RIGHT], t[..., SHOWN]),
        "chars_saved": lambda t: _ratio(t[..., SAVED], t[..., TYPED]),
        "reward_per_request": reward_per_request,
    }


def _seed_rows(sessions: Sessions) -> list[np.ndarray]:
    seeds = [np.asarray(s, dtype=float).reshape(-1, 6) for s in sessions]
    if not seeds or any(len(s) == 0 for s in seeds):
        raise ValueError("every seed needs at least one typing session")
    return seeds


def _resampled_totals(*arms: Sessions, n_boot: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Per arm, (n_boot, 6) column sums of hierarchical resamples: seeds with replacement, then sessions
    within. Several arms (paired) get the same picks: their seeds and sessions must correspond."""
    seeds = [_seed_rows(a) for a in arms]
    totals = [np.zeros((n_boot, 6)) for _ in arms]
    picks = rng.integers(0, len(seeds[0]), size=(n_boot, len(seeds[0])))
    for b in range(n_boot):
        for k in picks[b]:
            rows = rng.integers(0, len(seeds[0][k]), size=len(seeds[0][k]))
            for total, arm in zip(totals, seeds, strict=True):
                total[b] += arm[k][rows].sum(axis=0)
    return totals


def pair_sessions(a: Sessions, b: Sessions) -> tuple[list, list, int]:
    """(a, b) with each seed's session lists made the same length, and how many sessions were added. Both
    typed the same regions in the same order (seed k of each with the same users), so sessions correspond
    by position; the request cap may stop one model a few regions before the other, and a tail session
    typed by one side only is paired with an empty one (all counts 0): every ratio, the point value
    included, is then what it is on all the data."""
    if len(a) != len(b):
        raise ValueError(f"a paired difference needs the same seeds on both sides: {len(a)} vs {len(b)}")
    out_a, out_b, added = [], [], 0
    for sa, sb in zip(a, b, strict=True):
        n = max(len(sa), len(sb))
        out_a.append([*sa, *[[0] * 6] * (n - len(sa))])
        out_b.append([*sb, *[[0] * 6] * (n - len(sb))])
        added += 2 * n - len(sa) - len(sb)
    return out_a, out_b, added


@dataclass(frozen=True)
class Interval:
    value: float  # the metric on all the data
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.value:.4f} [{self.low:.4f}, {self.high:.4f}]"


def _point(sessions: Sessions) -> np.ndarray:
    return np.sum([np.asarray(s, dtype=float).reshape(-1, 6).sum(axis=0) for s in sessions], axis=0)


def interval(
    sessions: Sessions, metric: Callable[[np.ndarray], np.ndarray], n_boot: int = 2000, seed: int = 0
) -> Interval:
    boot = metric(_resampled_totals(sessions, n_boot=n_boot, rng=np.random.default_rng(seed))[0])
    low, high = np.percentile(boot, [2.5, 97.5])
    return Interval(float(metric(_point(sessions))), float(low), float(high))


def difference(
    a: Sessions,
    b: Sessions,
    metric: Callable[[np.ndarray], np.ndarray],
    n_boot: int = 2000,
    seed: int = 0,
    relative: bool = False,
    paired: bool = False,
) -> Interval:
    """CI of metric(a) - metric(b), or of metric(a) / metric(b) - 1 when relative. paired: a and b typed the
    same regions with the same seeds (see the module doc); their sessions are lined up (``pair_sessions``)
    and resampled together."""
    rng = np.random.default_rng(seed)
    if paired:
        a, b, _ = pair_sessions(a, b)
        ma, mb = map(metric, _resampled_totals(a, b, n_boot=n_boot, rng=rng))
    else:
        ma = metric(_resampled_totals(a, n_boot=n_boot, rng=rng)[0])
        mb = metric(_resampled_totals(b, n_boot=n_boot, rng=rng)[0])
    pa, pb = float(metric(_point(a))), float(metric(_point(b)))
    if relative:
        boot, value = _ratio(ma, mb) - 1.0, (pa / pb - 1.0 if pb else 0.0)
    else:
        boot, value = ma - mb, pa - pb
    low, high = np.percentile(boot, [2.5, 97.5])
    return Interval(value, float(low), float(high))
