"""What a suggestion's outcome is worth: the one place that prices outcomes.

Every request ends one of three ways: the suggestion was taken (``accepted``), shown and not taken
(``rejected``), or nothing was shown (``abstained``). params ``reward`` prices each (Cursor's Tab
RL: +0.75 / -0.25 / 0). Training, the evaluation, the gate, the A/B decision, the intervals and the
benchmarks all price outcomes through this module, so changing the reward rule is a one-file edit.

The totals work on plain numbers and on numpy arrays alike (the bootstrap prices many resamples at
once): they are sums of counts times prices, computed from (requests, shown, accepted).

``ArmCounts`` is the one counts type: what one arm (or one run) served, by outcome, and the characters its users
took. The simulator's, the typing sessions', the ingest's and the A/B test's summaries are all ``ArmCounts`` with
their own extras; the rates and the prices are computed here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

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


def taken_chars(outcome: str, suggestion: str, reported: int | None) -> int:
    """Characters a user took from one suggestion: the client's count when it reported one (feedback's
    `accepted_chars`), else the whole suggestion; 0 unless accepted. The A/B test's SQL counts the same."""
    if outcome != "accepted":
        return 0
    return len(suggestion) if reported is None else reported


@dataclass(frozen=True, kw_only=True)
class ArmCounts:
    """Decided requests of one arm (or run) by outcome, and the characters of the accepted suggestions.

    Requests and shown suggestions are derived, so the counts always add up."""

    accepted: int
    rejected: int  # shown and not taken
    abstained: int  # nothing shown
    accepted_chars: int  # characters users took from accepted suggestions

    def __post_init__(self) -> None:
        for name in ("accepted", "rejected", "abstained", "accepted_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is negative; counts are never below 0")

    @property
    def requests(self) -> int:
        return self.accepted + self.rejected + self.abstained

    @property
    def shown(self) -> int:
        return self.accepted + self.rejected

    @property
    def suggest_rate(self) -> float:
        """Shown suggestions per request."""
        return self.shown / self.requests if self.requests else 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted per shown suggestion."""
        return self.accepted / self.shown if self.shown else 0.0

    @property
    def chars_per_request(self) -> float:
        """Accepted characters per request."""
        return self.accepted_chars / self.requests if self.requests else 0.0


def reward_per_request(counts: ArmCounts, reward: RewardParams) -> float:
    """Mean reward per request: what the policy earns per completion request (0 with no request)."""
    n = counts.requests
    return float(total_reward(n, counts.shown, counts.accepted, reward)) / n if n else 0.0


def reward_std(counts: ArmCounts, reward: RewardParams) -> float:
    """Sample standard deviation of the per-request reward (0 with fewer than two requests)."""
    n = counts.requests
    squares = total_squared_reward(n, counts.shown, counts.accepted, reward)
    return sample_std(n, reward_per_request(counts, reward), squares)


def sample_std(n: int, mean: float, sum_of_squares: float) -> float:
    """Sample standard deviation of n values from their mean and the sum of their squares (0 below two values)."""
    if n < 2:
        return 0.0
    return math.sqrt(max(sum_of_squares - n * mean * mean, 0.0) / (n - 1))
