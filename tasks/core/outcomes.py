"""What a suggestion's outcome is worth, and what counts as an outcome: the one place for both.

Every logged completion ends one of five ways (``Outcome``). Three are decided requests, counted and trained on
(``OUTCOMES``): the suggestion was taken (``accepted``), shown and not taken (``rejected``), or nothing was
shown (``abstained``). Two were never shown (``NEVER_SHOWN``), so they are never trained on and never counted
in any rate, A/B test or snapshot:

* ``cancelled``: the client hung up before the answer was sent (an editor aborts a request when the user types
  on). The gateway sees it and stamps the row (``completions.cancelled_at``); see docs/concepts/outcomes.md for
  where the boundary lies.
* ``not_shown``: the client said it never displayed the suggestion (``/v1/feedback`` with ``shown: false``), or
  the client reports its own outcomes (its key's ``reports_outcomes``, stamped on the row when it was served)
  and reported none by the deadline: Continue sends nothing for a completion it discarded or the user typed
  through.

The timeout rule (``outcome_of``, and ``outcome_conditions`` in SQL): a suggestion served at ``created_at`` is
decided at its deadline, ``created_at`` + ``ingest.feedback_timeout_s`` (``ingest.reported_timeout_s`` for a
client that reports its own outcomes: Continue reports a rejection 10 s after display, plus the latency).
Feedback received by the deadline decides it; none by then is a rejection (``not_shown`` for a reporting
client); feedback after it is late and never changes the outcome, so a snapshot rebuilt from the same rows
gives the same outcomes.

params ``reward`` prices each decided outcome (Cursor's Tab RL: +0.75 / -0.25 / 0). Training, the evaluation,
the gate, the A/B decision, the intervals and the benchmarks all price outcomes through this module, so
changing the reward rule is a one-file edit.

The totals work on plain numbers and on numpy arrays alike (the bootstrap prices many resamples at
once): they are sums of counts times prices, computed from (requests, shown, accepted).

``ArmCounts`` is the one counts type: what one arm (or one run) served, by outcome, and the characters its users
took. The simulator's, the typing sessions', the ingest's and the A/B test's summaries are all ``ArmCounts`` with
their own extras; the rates and the prices are computed here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Literal

import sqlalchemy as sa

from tasks.core.config import IngestParams, RewardParams

Outcome = Literal["accepted", "rejected", "abstained", "cancelled", "not_shown"]
OUTCOMES: Final = ("accepted", "rejected", "abstained")  # decided requests: counted, priced, trained on
NEVER_SHOWN: Final = ("cancelled", "not_shown")  # logged, never counted, never trained on


def timeout_s(reports_outcomes: bool | None, ingest: IngestParams) -> float:
    """How long after it was served a completion waits for its outcome: longer for a client that reports its
    own outcomes (NULL, as older rows have it: a client that does not)."""
    return ingest.reported_timeout_s if reports_outcomes else ingest.feedback_timeout_s


def deadline(created_at: float, reports_outcomes: bool | None, ingest: IngestParams) -> float:
    """The timeout rule: a completion served at `created_at` is decided at `created_at` + its timeout. Feedback
    received by the deadline decides it; feedback after it is late and never changes the outcome.
    `deadline_sql` is the same rule in SQL; nothing else writes it."""
    return created_at + timeout_s(reports_outcomes, ingest)


def deadline_sql(
    created_at: sa.ColumnElement[float], reports_outcomes: sa.ColumnElement[bool], ingest: IngestParams
) -> sa.ColumnElement[float]:
    """`deadline` as an SQL expression over a completions row's `created_at` and `reports_outcomes` columns."""
    reports = sa.func.coalesce(reports_outcomes, sa.false())
    return created_at + sa.case((reports, ingest.reported_timeout_s), else_=ingest.feedback_timeout_s)


def outcome_of(
    *,
    cancelled: bool,
    abstained: bool,
    reports_outcomes: bool | None,
    created_at: float,
    received_at: float | None,
    accepted: bool | None,
    shown: bool | None,
    ingest: IngestParams,
) -> tuple[Outcome, bool]:
    """(outcome, late): the rule for one completion whose deadline has passed, from its row (cancelled,
    abstained, reports_outcomes, created_at) and its feedback (received_at, accepted, shown; None: none).
    late: feedback came after the deadline (it is recorded, never used)."""
    if cancelled:
        return "cancelled", False
    if abstained:
        return "abstained", False
    silent: Outcome = "not_shown" if reports_outcomes else "rejected"
    if received_at is None:
        return silent, False
    if received_at > deadline(created_at, reports_outcomes, ingest):
        return silent, True
    if shown is False:
        return "not_shown", False
    return ("accepted" if accepted else "rejected"), False


@dataclass(frozen=True)
class OutcomeSql:
    """The rule of `outcome_of` as SQL conditions over completions joined with their (matched) feedback, as of
    `now` (feedback received after `now` must be left out of the join). Exactly one of cancelled, abstained,
    accepted, rejected, not_shown and pending holds for each row."""

    cancelled: sa.ColumnElement[bool]
    abstained: sa.ColumnElement[bool]
    accepted: sa.ColumnElement[bool]
    not_shown: sa.ColumnElement[bool]
    pending: sa.ColumnElement[bool]  # answered, shown, its deadline still ahead with no feedback: undecided
    timed_out: sa.ColumnElement[bool]  # part of rejected: no feedback at all by the deadline (a silent client)


def outcome_conditions(completions: sa.Table, feedback: sa.Table, ingest: IngestParams, now: float) -> OutcomeSql:
    c, f = completions, feedback
    cancelled = c.c.cancelled_at.is_not(None)
    answered = sa.not_(cancelled)
    offered = sa.and_(answered, sa.not_(c.c.abstained))  # a suggestion was sent to the client
    reports = sa.func.coalesce(c.c.reports_outcomes, sa.false())
    due = deadline_sql(c.c.created_at, c.c.reports_outcomes, ingest)
    in_time = sa.and_(f.c.completion_id.is_not(None), f.c.received_at <= due)
    said_not_shown = sa.and_(in_time, sa.func.coalesce(f.c.shown, sa.true()) == sa.false())
    decided = due <= now
    return OutcomeSql(
        cancelled=cancelled,
        abstained=sa.and_(answered, c.c.abstained),
        accepted=sa.and_(offered, in_time, f.c.accepted, sa.not_(said_not_shown)),
        not_shown=sa.and_(offered, sa.or_(said_not_shown, sa.and_(reports, decided, sa.not_(in_time)))),
        pending=sa.and_(offered, sa.not_(decided), sa.not_(in_time)),
        timed_out=sa.and_(offered, sa.not_(reports), decided, f.c.completion_id.is_(None)),
    )


def reward_of(outcome: str, reward: RewardParams) -> float:
    """The reward of one decided outcome (a never-shown one has none: it is never trained on)."""
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
    cancelled: int = 0  # never shown: the client hung up before the answer (not a request of any rate)
    not_shown: int = 0  # never shown: the client discarded it, or a reporting client reported nothing

    def __post_init__(self) -> None:
        for name in ("accepted", "rejected", "abstained", "accepted_chars", "cancelled", "not_shown"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is negative; counts are never below 0")

    @property
    def requests(self) -> int:
        """Decided requests: what every rate is over (never-shown completions are not requests of any rate)."""
        return self.accepted + self.rejected + self.abstained

    @property
    def logged(self) -> int:
        """Every completion logged, never-shown ones included."""
        return self.requests + self.cancelled + self.not_shown

    @property
    def cancel_rate(self) -> float:
        """Cancelled per logged completion: how often users typed on before the answer came (a latency guardrail,
        shown beside the A/B numbers, never part of them)."""
        return self.cancelled / self.logged if self.logged else 0.0

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
