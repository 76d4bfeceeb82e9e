"""What a suggestion's outcome is worth: the one place that prices outcomes.

Every request ends one of three ways: the suggestion was taken (``accepted``), shown and not taken
(``rejected``), or nothing was shown (``abstained``). params ``reward`` prices each (Cursor's Tab
RL: +0.75 / -0.25 / 0). Training, the evaluation, the gate, the A/B decision, the intervals and the
benchmarks all price outcomes through this module, so changing the reward rule is a one-file edit.

The totals work on plain numbers and on numpy arrays alike (the bootstrap prices many resamples at
once): they are sums of counts times prices, computed from (requests, shown, accepted).
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import sqlalchemy as sa

from tasks.core.config import RewardParams

OUTCOMES: Final = ("accepted", "rejected", "abstained")


def deadline(created_at: float, timeout_s: float) -> float:
    """The timeout rule: a suggestion served at `created_at` is decided at its deadline, `created_at` +
    ingest.feedback_timeout_s. Feedback received by the deadline decides it; none by then is a rejection; feedback
    after it is late and never changes the outcome. `deadline_sql` is the same rule in SQL; nothing else writes it."""
    return created_at + timeout_s


def deadline_sql(created_at: sa.ColumnElement[float], timeout_s: float) -> sa.ColumnElement[float]:
    """`deadline` as an SQL expression over a `completions.created_at` column."""
    return created_at + timeout_s


def reward_of(outcome: str, reward: RewardParams) -> float:
    """The reward of one outcome."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
    return float(getattr(reward, outcome))


def total_reward(requests: Any, shown: Any, accepted: Any, reward: RewardParams) -> Any:
    """Sum of rewards over requests with these counts (rejected = shown - accepted, abstained = requests - shown).

    Counts are numbers or numpy arrays of them (hence Any)."""
    rejected = shown - accepted
    abstained = requests - shown
    return accepted * reward.accepted + rejected * reward.rejected + abstained * reward.abstained


def total_squared_reward(requests: Any, shown: Any, accepted: Any, reward: RewardParams) -> Any:
    """Sum of squared rewards over requests with these counts (for the per-request reward's variance)."""
    squared = reward.model_copy(
        update={"accepted": reward.accepted**2, "rejected": reward.rejected**2, "abstained": reward.abstained**2}
    )
    return total_reward(requests, shown, accepted, squared)


class Counts(Protocol):
    """What any per-arm or per-run summary counts (the simulator's, the typing sessions', the A/B test's)."""

    @property
    def requests(self) -> int: ...
    @property
    def shown(self) -> int: ...
    @property
    def accepted(self) -> int: ...


def reward_per_request(counts: Counts, reward: RewardParams) -> float:
    """Mean reward per request: what the policy earns per completion request (0 with no request)."""
    n = counts.requests
    return float(total_reward(n, counts.shown, counts.accepted, reward)) / n if n else 0.0
