"""Does an arm's latency leak into the A/B decision? What the benchmark (bench/cancel_bias.py) and the test
(tests/test_cancel_bias.py) share: per-arm counts read from the log store under today's rule and under the rule
before 2026-12-02 (a completion whose client hung up counted as shown and rejected, and one the client said it never
displayed too), and A/B tests between two equal models that differ only in latency, simulated at the counts level
with the decision code (`tasks.deploy.ab.decide`) on cancel rates measured through the gateway.

    rates = measured_rates(engine, params)                      # per arm, from a run through the gateway
    tally = simulate_ab_tests(rates["slow"], rates["fast"], pooled, per_arm=2000, trials=400, params, rule="new")
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tasks.core.config import Params
from tasks.core.outcomes import ArmCounts
from tasks.core.store import CHALLENGER, CHAMPION, completions
from tasks.deploy.ab import ArmLatency, ArmStats, arm_stats, decide, stats_from_counts

Rule = Literal["new", "old"]


@dataclass(frozen=True)
class ArmRates:
    """One arm's logged completions by fate (from the store, as of a look after every deadline passed)."""

    logged: int
    cancelled: int
    cancelled_with_text: int  # of cancelled: the suggestion was made before the hang-up (an old gateway showed it)
    not_shown: int
    counts: ArmCounts  # the decided requests under today's rule
    latency: ArmLatency | None = None  # the gateway's latency of those decided requests

    @property
    def cancel_rate(self) -> float:
        return self.cancelled / self.logged if self.logged else 0.0

    @property
    def never_shown_rate(self) -> float:
        return (self.cancelled + self.not_shown) / self.logged if self.logged else 0.0

    def under(self, rule: Rule) -> ArmCounts:
        """The counts today's rule records, or the ones the rule before 2026-12-02 would have: a completion whose
        client hung up was shown and rejected (abstained when it had no text), and so was one never displayed. A
        hang-up that came before the model finished left no text here, where the old gateway generated on: those
        are counted at the arm's own suggestion rate (rounded), the one estimate in these counts."""
        c = self.counts
        if rule == "new":
            return c
        unfinished = self.cancelled - self.cancelled_with_text
        would_show = round(unfinished * c.suggest_rate)
        return ArmCounts(
            accepted=c.accepted,
            rejected=c.rejected + self.cancelled_with_text + would_show + self.not_shown,
            abstained=c.abstained + unfinished - would_show,
            accepted_chars=c.accepted_chars,
        )


def measured_rates(engine: Engine, params: Params, since: float = 0.0) -> dict[str, ArmRates]:
    """Every live arm's fates since `since` (run after the deadlines passed)."""
    stats = arm_stats(engine, params, since=since)
    c = completions
    with_text = (
        sa.select(c.c.arm, sa.func.count())
        .where(c.c.cancelled_at.is_not(None), c.c.completion != "", c.c.created_at >= since)
        .group_by(c.c.arm)
    )
    with engine.connect() as conn:
        texts = dict(conn.execute(with_text).tuples().all())
    return {
        arm: ArmRates(
            logged=s.logged,
            cancelled=s.cancelled,
            cancelled_with_text=int(texts.get(arm, 0)),
            not_shown=s.not_shown,
            counts=ArmCounts(
                accepted=s.accepted, rejected=s.rejected, abstained=s.abstained, accepted_chars=s.accepted_chars
            ),
            latency=s.latency,
        )
        for arm, s in stats.items()
    }


def _binomial(rng: np.random.Generator, n: int, p: float) -> int:
    return int(rng.binomial(n, min(max(p, 0.0), 1.0))) if n > 0 else 0


def _arm(rng: np.random.Generator, rates: ArmRates, pooled: ArmCounts, n: int, rule: Rule, name: str, params: Params):
    """One simulated arm of n logged completions: its own cancel (and not-shown) rate, the pooled model's
    suggestion and accept rates (the two models are equal), priced under `rule`."""
    cancelled = _binomial(rng, n, rates.cancel_rate)
    not_shown = _binomial(rng, n - cancelled, rates.not_shown / max(rates.logged - rates.cancelled, 1))
    decided = n - cancelled - not_shown
    shown = _binomial(rng, decided, pooled.suggest_rate)
    accepted = _binomial(rng, shown, pooled.accept_rate)
    chars = round(accepted * (pooled.accepted_chars / pooled.accepted if pooled.accepted else 0.0))
    counts = ArmCounts(
        accepted=accepted,
        rejected=shown - accepted,
        abstained=decided - shown,
        accepted_chars=chars,
        cancelled=cancelled,
        not_shown=not_shown,
    )
    if rule == "old":  # the hung-up ones that had a suggestion (the pooled share of them) and the discarded ones
        had_text = _binomial(rng, cancelled, pooled.suggest_rate)
        counts = ArmCounts(
            accepted=accepted,
            rejected=shown - accepted + had_text + not_shown,
            abstained=decided - shown + cancelled - had_text,
            accepted_chars=chars,
        )
    return stats_of(name, counts, params)


def stats_of(name: str, counts: ArmCounts, params: Params) -> ArmStats:
    """One arm's stats (its name as its version too) from its counts, never-shown ones counted apart."""
    return stats_from_counts(
        name,
        name,
        counts.accepted,
        counts.rejected,
        counts.abstained,
        params.reward,
        cancelled=counts.cancelled,
        not_shown=counts.not_shown,
        accepted_chars=counts.accepted_chars,
    )


def verdict(champion: ArmStats, challenger: ArmStats, params: Params) -> str:
    """`better` (promoted), `worse` (rolled back as worse), or `neither` (inconclusive, or kept collecting)."""
    d = decide(champion, challenger, params)
    if d.action == "promote":
        return "better"
    return "worse" if d.action == "rollback" and d.reason.startswith("challenger worse") else "neither"


def simulate_ab_tests(
    challenger: ArmRates,
    champion: ArmRates,
    pooled: ArmCounts,
    per_arm: int,
    trials: int,
    params: Params,
    rule: Rule,
    seed: int = 0,
) -> Counter:
    """How often `decide` judges the challenger better, worse or neither over `trials` A/B tests of `per_arm`
    logged completions each, looked at once (deploy.max_samples = what each arm decided)."""
    rng = np.random.default_rng([seed, per_arm, 0 if rule == "new" else 1])
    tally: Counter = Counter()
    for _ in range(trials):
        a = _arm(rng, champion, pooled, per_arm, rule, CHAMPION, params)
        b = _arm(rng, challenger, pooled, per_arm, rule, CHALLENGER, params)
        look = params.model_copy(
            update={"deploy": params.deploy.model_copy(update={"max_samples": min(a.requests, b.requests)})}
        )
        tally[verdict(a, b, look)] += 1
    return tally


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson 95 % interval of a binomial proportion k / n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
