"""Live A/B statistics per arm and the promote / roll back / keep collecting decision.

Counting (per arm, completions served by the arm's current model version since the live arm set was written,
i.e. since the challenger went live; each team's test on what its own arms served, since their last change):

* a request is a completion row; an abstained one (empty suggestion) is a request with nothing shown;
* a shown suggestion is accepted when its feedback says so within `ingest.feedback_timeout_s` of the
  completion; feedback that says no, feedback that comes later (the user did not press Tab in time,
  the same rule as ingest), or no feedback once the timeout has passed count as rejected;
* a shown suggestion younger than the timeout with no feedback yet is pending: it is left out of
  every number (requests included), so the rates never count an undecided row as a rejection;
* a completion never shown (cancelled, not shown: ``tasks.core.outcomes``, whose rule this counts by) is no
  request: counted apart (``cancel_rate``, a latency guardrail), in no rate, or a slower arm, whose answers users
  type past more often, would lose for its latency.

Metrics: suggestion rate = shown / requests; accept rate = accepted / shown; reward per request =
mean of `reward.accepted` / `reward.rejected` / `reward.abstained` over requests (the quantity the
policy is trained to raise; it prices abstaining against a rejection); characters per request =
accepted characters (the feedback's `accepted_chars`, else the suggestion's length) / requests;
latency p50 / p95 of the same requests (`completions.latency_ms`; shown, not part of the rule).

Decision rule (`decide`), each test two-sided at `deploy.alpha`:

1. Both arms need `deploy.min_samples` shown suggestions; before that: continue.
2. Primary: Welch's t-test on reward per request. Significantly higher -> promote; lower -> roll back.
3. Secondary (reward not significant): two-proportion z-test on accept rate. Significantly higher
   and the challenger's reward per request not lower than the champion's (point estimates) -> promote;
   significantly lower and its reward not higher -> roll back. So a challenger whose reward estimate is
   below the champion's is never promoted on acceptance alone.
4. Otherwise continue, until both arms have `deploy.max_samples` requests: then roll back
   (inconclusive; the champion stays and the next cycle may start).
5. No reward hacking: a challenger that 2. or 3. would promote is rolled back instead when its
   accepted characters per request are significantly more than `deploy.chars_tolerance` (relative)
   below the champion's (one-sided Welch t-test at `deploy.alpha` of challenger < (1 - tolerance) x
   champion): it raised reward or accept rate by showing less while users type more themselves.
   A test, not the point estimates: characters per request come from few accepted suggestions (about
   one request in 40 here), so at a few hundred requests per arm the estimates' ratio varies by +-40 %
   and a point rule rolls back an equal challenger about half the time (docs/decisions/ab-chars-guard.md).
   The gate's held-out characters-saved check stays a point rule over far more evidence.

The decision flow looks at the data every few minutes; repeated looks raise the false-positive rate
above alpha (no sequential correction is made). `min_samples` keeps the earliest, noisiest looks out.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from scipy import stats as st
from sqlalchemy.engine import Connection, Engine

from tasks.core import outcomes, vocab
from tasks.core.config import DeployParams, Params, RewardParams
from tasks.core.outcomes import ArmCounts, OutcomeSql, outcome_conditions
from tasks.core.store import CHALLENGER, CHAMPION, completions, feedback
from tasks.core.store import arms as arms_table
from tasks.core.teams import ORG, scope_is


@dataclass(frozen=True)
class ArmLatency:
    """Quantiles of an arm's logged latency (`completions.latency_ms`) over the requests its stats count."""

    p50_ms: float
    p95_ms: float


@dataclass(frozen=True, kw_only=True)
class ArmStats(ArmCounts):
    """One live arm's counts (decided requests: pending ones left out; rejected = an explicit no, a late
    answer, or timed out), priced by `reward`, with what the A/B look adds."""

    arm: str
    model_version: str
    timed_out: int  # part of rejected: no feedback within the timeout
    pending: int  # shown, no feedback yet, younger than the timeout (not counted anywhere else)
    reward: RewardParams  # the prices of the outcomes (params.reward)
    accepted_chars_sq: float = 0.0  # sum over accepted suggestions of their characters squared (for chars_std)
    latency: ArmLatency | None = None  # over the same requests; None without any (not an input of the rule)

    @property
    def reward_per_request(self) -> float:
        return outcomes.reward_per_request(self, self.reward)

    @property
    def reward_std(self) -> float:
        """Sample standard deviation of the per-request reward."""
        return outcomes.reward_std(self, self.reward)

    @property
    def chars_std(self) -> float:
        """Sample standard deviation of the accepted characters per request (0 on an accept, else nothing)."""
        return outcomes.sample_std(self.requests, self.chars_per_request, self.accepted_chars_sq)

    def as_record(self) -> dict[str, Any]:
        """Every number by name, as the decision record and `Decision.numbers` write them."""
        return {
            "arm": self.arm,
            "model_version": self.model_version,
            "requests": self.requests,
            "shown": self.shown,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "timed_out": self.timed_out,
            "abstained": self.abstained,
            "pending": self.pending,
            "cancelled": self.cancelled,
            "not_shown": self.not_shown,
            "cancel_rate": self.cancel_rate,
            "suggest_rate": self.suggest_rate,
            "accept_rate": self.accept_rate,
            "reward_per_request": self.reward_per_request,
            "reward_std": self.reward_std,
            "accepted_chars": self.accepted_chars,
            "chars_per_request": self.chars_per_request,
            "chars_std": self.chars_std,
            "latency": None if self.latency is None else asdict(self.latency),
        }


@dataclass(frozen=True)
class Decision:
    action: vocab.Action
    reason: str
    numbers: dict[str, float]


def stats_from_counts(
    arm: str,
    model_version: str,
    accepted: int,
    rejected: int,
    abstained: int,
    reward: RewardParams,
    *,
    timed_out: int = 0,
    pending: int = 0,
    cancelled: int = 0,
    not_shown: int = 0,
    accepted_chars: int = 0,
    accepted_chars_sq: float | None = None,
    latency: ArmLatency | None = None,
) -> ArmStats:
    """One arm's stats from its outcome counts. Without accepted_chars_sq, every accepted suggestion is taken to
    be of the mean length (the least spread the totals allow: the hacking test then errs towards rolling back)."""
    if accepted_chars_sq is None:
        accepted_chars_sq = accepted_chars * accepted_chars / accepted if accepted else 0.0
    return ArmStats(
        arm=arm,
        model_version=model_version,
        accepted=accepted,
        rejected=rejected,
        abstained=abstained,
        accepted_chars=accepted_chars,
        accepted_chars_sq=accepted_chars_sq,
        timed_out=timed_out,
        pending=pending,
        cancelled=cancelled,
        not_shown=not_shown,
        reward=reward,
        latency=latency,
    )


def live_since(engine: Engine, team: str = ORG) -> float | None:
    """When `team`'s live arm set was written (its challenger went live then); None without arms."""
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.max(arms_table.c.updated_at)).where(arms_table.c.team == team)).scalar()


def _count(cond: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
    return sa.func.coalesce(sa.func.sum(sa.case((cond, 1), else_=0)), 0)


def _counts_by_arm(joined: sa.FromClause, in_window: sa.ColumnElement[bool], o: OutcomeSql) -> sa.Select[Any]:
    """Per (arm, model version) in the window: rows, each outcome's count (the core's rule, `o`), accepted
    characters and the sum of their squares."""
    c, f = completions, feedback
    taken = sa.func.coalesce(f.c.accepted_chars, sa.func.length(c.c.completion))  # outcomes.taken_chars, in SQL
    return (
        sa.select(
            c.c.arm,
            c.c.model_version,
            sa.func.count().label("rows"),
            _count(o.cancelled).label("cancelled"),
            _count(o.not_shown).label("not_shown"),
            _count(o.abstained).label("abstained"),
            _count(o.accepted).label("accepted"),
            _count(o.pending).label("pending"),
            _count(o.timed_out).label("timed_out"),
            sa.func.coalesce(sa.func.sum(sa.case((o.accepted, taken), else_=0)), 0).label("accepted_chars"),
            sa.func.coalesce(sa.func.sum(sa.case((o.accepted, taken * taken), else_=0)), 0).label("accepted_chars_sq"),
        )
        .select_from(joined)
        .where(in_window)
        .group_by(c.c.arm, c.c.model_version)
    )


def arm_stats(
    engine: Engine, params: Params, *, since: float | None = None, now: float | None = None, team: str = ORG
) -> dict[str, ArmStats]:
    """Stats of every live arm of `team` (by arm name) over the completions its current model version served
    since `since` (default: when the team's arm set was written), with the timeout rule applied as of `now`;
    latency quantiles over the same (decided) requests. Never-shown completions are counted apart, in no rate."""
    now = time.time() if now is None else now
    since = live_since(engine, team) if since is None else since
    if since is None:
        return {}
    c, f = completions, feedback
    o = outcome_conditions(c, f, params.ingest, now)
    # Feedback that arrives after `now` does not exist yet as far as this look is concerned.
    joined = c.outerjoin(f, sa.and_(f.c.completion_id == c.c.id, f.c.received_at <= now))
    in_window = sa.and_(c.c.created_at >= since, c.c.created_at <= now, scope_is(c.c.arm_team, team))
    query = _counts_by_arm(joined, in_window, o)
    counted = sa.not_(sa.or_(o.pending, o.cancelled, o.not_shown))
    live_arms = sa.select(arms_table.c.name, arms_table.c.model_version).where(arms_table.c.team == team)
    with engine.connect() as conn:
        live = conn.execute(live_arms).all()
        rows = {(r.arm, r.model_version): r for r in conn.execute(query)}
        out = {}
        for name, version in live:
            r = rows.get((name, version))
            if r is None:
                out[name] = stats_from_counts(name, version, 0, 0, 0, params.reward)
                continue
            decided = (
                sa.select(c.c.latency_ms)
                .select_from(joined)
                .where(in_window, c.c.arm == name, c.c.model_version == version, counted)
            )
            requests = r.rows - r.pending - r.cancelled - r.not_shown
            out[name] = stats_from_counts(
                name,
                version,
                int(r.accepted),
                int(requests - r.abstained - r.accepted),
                int(r.abstained),
                params.reward,
                timed_out=int(r.timed_out),
                pending=int(r.pending),
                cancelled=int(r.cancelled),
                not_shown=int(r.not_shown),
                accepted_chars=int(r.accepted_chars),
                accepted_chars_sq=float(r.accepted_chars_sq),
                latency=arm_latency(conn, decided, int(requests)),
            )
    return out


def arm_latency(conn: Connection, latencies: sa.Select[tuple[float]], n: int) -> ArmLatency | None:
    """p50 and p95 of the n values `latencies` selects (one column, `completions.latency_ms`); None when n is 0."""
    if n == 0:
        return None
    return ArmLatency(quantile_of(conn, latencies, n, 0.5), quantile_of(conn, latencies, n, 0.95))


def quantile_of(conn: Connection, values: sa.Select[tuple[float]], n: int, q: float) -> float:
    """The q-quantile of the n values a one-column select gives, linearly interpolated between the closest ranks
    (numpy's default, PostgreSQL's percentile_cont; the gateway's /metrics gauges use the same). The database
    sorts and returns the two values around rank q * (n - 1), so SQLite and PostgreSQL give the same number
    and no more than two rows leave the store however many an arm has served."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile q={q} must be within [0, 1]")
    rank = q * (n - 1)
    below = math.floor(rank)
    column = values.selected_columns[0]
    around = conn.execute(values.order_by(column).limit(2).offset(below)).scalars().all()
    if not around:  # rows deleted between the counts and this query (a purge): the next look counts again
        raise ValueError(f"the log store changed while it was read: fewer than {below + 1} latencies, not {n}")
    upper = around[1] if len(around) > 1 else around[0]
    return float(around[0] + (upper - around[0]) * (rank - below))


def two_proportion_test(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """Pooled two-proportion z-test of x2/n2 vs x1/n1: (z, two-sided p). No variance -> (0, 1)."""
    if n1 == 0 or n2 == 0:
        return 0.0, 1.0
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 0.0, 1.0
    z = (x2 / n2 - x1 / n1) / se
    return z, float(2 * st.norm.sf(abs(z)))


def welch_test(a: ArmStats, b: ArmStats) -> tuple[float, float]:
    """Welch's t-test of b's reward per request vs a's: (t, two-sided p).

    Both arms without variance: p is 1 for equal means, 0 otherwise (t is then reported as 0).
    """
    if a.requests < 2 or b.requests < 2:
        return 0.0, 1.0
    if a.reward_std == 0 and b.reward_std == 0:
        return 0.0, 1.0 if a.reward_per_request == b.reward_per_request else 0.0
    result = st.ttest_ind_from_stats(
        b.reward_per_request, b.reward_std, b.requests, a.reward_per_request, a.reward_std, a.requests, equal_var=False
    )
    return float(result.statistic), float(result.pvalue)


def chars_shortfall_test(champion: ArmStats, challenger: ArmStats, tolerance: float) -> tuple[float, float]:
    """One-sided Welch's t-test that the challenger's accepted characters per request are below (1 - tolerance) x
    the champion's: (t, p). No spread on either side: p is 0 when the challenger is below, else 1."""
    if champion.requests < 2 or challenger.requests < 2:
        return 0.0, 1.0
    k = 1.0 - tolerance  # the champion's per-request characters scaled by k: mean and sd alike
    if challenger.chars_std == 0 and champion.chars_std == 0:
        return 0.0, 0.0 if challenger.chars_per_request < k * champion.chars_per_request else 1.0
    result = st.ttest_ind_from_stats(
        challenger.chars_per_request,
        challenger.chars_std,
        challenger.requests,
        k * champion.chars_per_request,
        k * champion.chars_std,
        champion.requests,
        equal_var=False,
        alternative="less",
    )
    return float(result.statistic), float(result.pvalue)


def _too_few_shown(champion: ArmStats, challenger: ArmStats, d: DeployParams, numbers: dict[str, float]) -> Decision:
    """Fewer than deploy.min_samples shown suggestions on an arm: keep collecting, or roll back at max_samples."""
    if d.max_samples is not None and min(champion.requests, challenger.requests) >= d.max_samples:
        return Decision(
            "rollback",
            f"inconclusive: {d.max_samples} requests per arm and still fewer than "
            f"{d.min_samples} shown suggestions (champion {champion.shown}, challenger "
            f"{challenger.shown})",
            numbers,
        )
    return Decision(
        "continue",
        f"collecting: {champion.shown}/{d.min_samples} shown suggestions on the champion, "
        f"{challenger.shown}/{d.min_samples} on the challenger",
        numbers,
    )


def decide(champion: ArmStats, challenger: ArmStats, params: Params) -> Decision:
    """Promote, roll back or continue by the rule in this module's docstring; `numbers` holds every input."""
    d = params.deploy
    z, p_accept = two_proportion_test(champion.accepted, champion.shown, challenger.accepted, challenger.shown)
    t, p_reward = welch_test(champion, challenger)
    d_accept = challenger.accept_rate - champion.accept_rate
    d_reward = challenger.reward_per_request - champion.reward_per_request
    numbers = {f"{CHAMPION}_{k}": float(v) for k, v in _numeric(champion).items()}
    numbers |= {f"{CHALLENGER}_{k}": float(v) for k, v in _numeric(challenger).items()}
    numbers |= {
        "accept_rate_diff": d_accept,
        "accept_z": z,
        "accept_p": p_accept,
        "reward_diff": d_reward,
        "reward_t": t,
        "reward_p": p_reward,
        "alpha": d.alpha,
        "min_samples": float(d.min_samples),
    }
    reward_sig = p_reward < d.alpha
    accept_sig = p_accept < d.alpha
    fmt = f"reward/request {challenger.reward_per_request:.4f} vs {champion.reward_per_request:.4f} (p={p_reward:.3g})"
    fmt_acc = f"accept rate {challenger.accept_rate:.3f} vs {champion.accept_rate:.3f} (p={p_accept:.3g})"

    if min(champion.shown, challenger.shown) < d.min_samples:
        return _too_few_shown(champion, challenger, d, numbers)
    t_chars, p_chars = chars_shortfall_test(champion, challenger, d.chars_tolerance)
    numbers |= {
        "chars_per_request_diff": challenger.chars_per_request - champion.chars_per_request,
        "chars_tolerance": d.chars_tolerance,
        "chars_t": t_chars,
        "chars_p": p_chars,
    }
    hacking = p_chars < d.alpha
    chars = f"accepted characters/request {challenger.chars_per_request:.2f} vs {champion.chars_per_request:.2f}"
    fmt_chars = f"{chars}, significantly more than {d.chars_tolerance:.0%} fewer (p={p_chars:.3g})"
    kept = f"{chars}: not significantly more than {d.chars_tolerance:.0%} fewer (p={p_chars:.3g})"
    if reward_sig and d_reward > 0:
        if hacking:
            return Decision("rollback", f"reward hacking: {fmt} but {fmt_chars}", numbers)
        return Decision("promote", f"challenger better: {fmt}; {kept}", numbers)
    if reward_sig and d_reward < 0:
        return Decision("rollback", f"challenger worse: {fmt}", numbers)
    if accept_sig and d_accept > 0 and d_reward >= 0:
        if hacking:
            return Decision("rollback", f"reward hacking: {fmt_acc} but {fmt_chars}", numbers)
        return Decision("promote", f"challenger better: {fmt_acc}, reward/request not lower ({fmt}); {kept}", numbers)
    if accept_sig and d_accept < 0 and d_reward <= 0:
        return Decision("rollback", f"challenger worse: {fmt_acc}, reward/request not higher ({fmt})", numbers)
    if d.max_samples is not None and min(champion.requests, challenger.requests) >= d.max_samples:
        return Decision("rollback", f"inconclusive after {d.max_samples} requests per arm: {fmt}; {fmt_acc}", numbers)
    return Decision("continue", f"no significant difference yet: {fmt}; {fmt_acc}", numbers)


def _numeric(s: ArmStats) -> dict[str, float]:
    return {k: v for k, v in s.as_record().items() if isinstance(v, (int, float))}
