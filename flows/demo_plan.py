"""The demo's plans, from this machine's measured pace: the A/B test's size (a power calculation), what the time
budget leaves for it, and, after the first cycle, the whole run's predicted wall time and what to do when this
machine cannot run the planned cycles and an A/B test that decides within the budget.

Every cap and choice here depends on wall times (and on cycle 1's traffic, all on the base, for the reward's sd),
never on the A/B test's outcomes, so its one look keeps its alpha (tasks/deploy/ab.py).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from scipy.stats import norm

from flows.loop_state import CycleRow
from flows.online_loop import run_online_loop
from tasks.core.config import Params, load_params
from tasks.core.outcomes import ArmCounts, reward_std

# The learning bench's measured setting (docs/results.md, "What the loop learns"), one cycle fewer: cycles of 1000
# requests, the gate typing evaluate.n_requests (1000) held-out requests per model and judging 100 FIM samples
# (the bench's lift levels off after cycle 3 or 4; the A/B test gets the fifth cycle's minutes). The closing table
# types CLOSING_REQUESTS per model, on requests no gate typed. (ingest.feedback_timeout_s stays 10 s: a simulated
# user's Tab queues behind the other users' requests, ~4 s with the A/B test's 96 users, and at 3 s nearly every
# accept came late and counted as a rejection.)
DEMO_SETTINGS = ["evaluate.n_samples=100"]
CLOSING_REQUESTS = 1000
AB_FIXED_S = 30.0  # the A/B test's rollout, gateway start and decision flow on 2 cores (seconds, a little over)
MIN_PER_ARM = 300  # the smallest A/B test the time budget may leave


@dataclass(frozen=True)
class AbPlan:
    per_arm: int  # requests per arm the test runs to (capped)
    needed: int  # requests per arm the power calculation asks for
    reward_sd: float  # per-request reward sd it used (cycle 1's traffic, all on the base)
    mde: float
    power: float  # asked for at mde
    alpha: float
    power_at_n: float  # what per_arm gives at mde (below `power` when capped)


def plan_ab(reward_sd: float, mde: float, alpha: float, power: float, max_per_arm: int) -> AbPlan:
    """Requests per arm for a two-sided test at alpha to find a difference mde in mean reward per request with the
    given power: n = 2 (z_{1-alpha/2} + z_power)^2 sd^2 / mde^2, capped at max_per_arm."""
    z = norm.ppf(1 - alpha / 2) + norm.ppf(power)
    needed = math.ceil(2 * z * z * reward_sd * reward_sd / (mde * mde))
    per_arm = min(needed, max_per_arm)
    return AbPlan(per_arm, needed, reward_sd, mde, power, alpha, power_at(per_arm, reward_sd, mde, alpha))


def power_at(per_arm: int, reward_sd: float, mde: float, alpha: float) -> float:
    """The two-sided test's power to find a difference mde with per_arm requests per arm."""
    return float(norm.cdf(math.sqrt(per_arm / 2) * mde / reward_sd - norm.ppf(1 - alpha / 2)))


def budget_per_arm(rows: list[CycleRow], elapsed_s: float, budget_s: float, params: Params) -> int:
    """Requests per arm the A/B test can serve in what budget_s leaves after elapsed_s: the cycles' traffic rate
    through the gateway, less the closing table (2 x CLOSING_REQUESTS typed at the gates' pace, their judged
    samples included, so a little over) and the test's fixed costs (rollout, gateway, the feedback timeout, the
    decision). It depends on wall times only, never on outcomes, so the one look keeps its alpha; at least
    MIN_PER_ARM."""
    if not any(r.traffic_s > 0 for r in rows) or not any(r.evaluate_s > 0 for r in rows):
        return MIN_PER_ARM
    left = ab_traffic_left_s(rows, elapsed_s, budget_s, params)
    return max(int(left * measured_pace(rows, params).traffic_rps / 2), MIN_PER_ARM)


def ab_traffic_left_s(rows: list[CycleRow], elapsed_s: float, budget_s: float, params: Params) -> float:
    """Seconds of A/B traffic that budget_s leaves after elapsed_s: less the closing table at the gates' pace, the
    test's fixed costs and the feedback timeout (negative when nothing is left)."""
    pace = measured_pace(rows, params)
    closing_s = 2 * CLOSING_REQUESTS / pace.gate_rps
    return budget_s - elapsed_s - closing_s - AB_FIXED_S - params.ingest.feedback_timeout_s


def another_cycle_fits(rows: list[CycleRow], elapsed_s: float, budget_s: float, params: Params) -> bool:
    """Whether one more cycle at the measured pace still leaves budget_s room for the closing table and an A/B test
    of MIN_PER_ARM requests per arm: what the demo asks when its planned cycles end with no candidate (the time it
    kept for the test would go unused)."""
    pace = measured_pace(rows, params)
    return ab_traffic_left_s(rows, elapsed_s + pace.cycle_s, budget_s, params) * pace.traffic_rps / 2 >= MIN_PER_ARM


@dataclass(frozen=True)
class AbFill:
    """The A/B test extended past its planned size with what the budget leaves: its traffic runs to about `until`
    (a time.perf_counter() deadline fixed before the test starts), at the pace its first round measured, up to
    max_per_arm. Wall time decides the extension, never the outcomes, so the one look keeps its alpha; and the
    more requests, the smaller the gain the test can find (one demo's final model gains 0.001-0.012 reward per
    request on held-out requests, docs/results.md, where the test is sized for --mde 0.014)."""

    until: float
    max_per_arm: int

    def target(self, served: dict[str, int], round_s: float, planned: int) -> int:
        """Requests per arm to run to, after a first round that decided `served` requests in round_s seconds."""
        rate = sum(served.values()) / max(round_s, 1e-9)
        reachable = int((sum(served.values()) + max(self.until - time.perf_counter(), 0.0) * rate) / 2)
        return min(self.max_per_arm, max(planned, reachable))


def base_reward_sd(row: CycleRow, params: Params) -> float:
    """The per-request reward sd of a cycle's online traffic (cycle 1: the base model serves all of it)."""
    shown = round(row.requests * row.suggest_rate)
    accepted = round(shown * row.accept_rate)
    counts = ArmCounts(accepted=accepted, rejected=shown - accepted, abstained=row.requests - shown, accepted_chars=0)
    return reward_std(counts, params.reward)  # characters play no part in it


@dataclass(frozen=True)
class Pace:
    """This machine's pace, measured on the demo's first cycle."""

    traffic_rps: float  # decided requests a second through the gateway (never-shown ones take time, count none)
    cycle_s: float  # one cycle end to end: traffic, the feedback timeout, ingest, training, the gate, the rollout
    train_s: float  # of which the update
    gate_rps: float  # requests a second the gate types (its judged samples included)


def measured_pace(rows: list[CycleRow], params: Params) -> Pace:
    """This machine's pace over the cycles of rows: the traffic and the gates over the cycles that timed them, a
    cycle and its training on average."""
    served = [r for r in rows if r.traffic_s > 0]
    gated = [r for r in rows if r.evaluate_s > 0]
    traffic_s = sum(r.traffic_s for r in served)
    traffic_rps = sum(r.requests for r in served) / traffic_s if served else float("inf")
    gate_rps = 2 * params.evaluate.n_requests * len(gated) / sum(r.evaluate_s for r in gated) if gated else float("inf")
    cycle_s = sum(cycle_wall_s(r, params) for r in rows) / len(rows)
    return Pace(traffic_rps, cycle_s, sum(r.train_s for r in rows) / len(rows), gate_rps)


def predicted_s(pace: Pace, elapsed_s: float, done: int, cycles: int, per_arm: int, params: Params) -> float:
    """The demo's wall time: elapsed_s after `done` cycles, the other cycles at the measured pace, an A/B test of
    per_arm decided requests per arm at the cycles' traffic rate (and its fixed costs), and the closing table."""
    ab_s = 2 * per_arm / pace.traffic_rps + AB_FIXED_S + params.ingest.feedback_timeout_s
    return elapsed_s + (cycles - done) * pace.cycle_s + ab_s + 2 * CLOSING_REQUESTS / pace.gate_rps


@dataclass(frozen=True)
class DemoPlan:
    pace: Pace
    cycles: int  # asked for
    per_arm: int  # the A/B test that decides: requests per arm at the asked-for power
    predicted_s: float  # the whole demo, run as asked, with that test
    budget_s: float
    fewer_cycles: int | None  # the most cycles that fit the budget with that test; None: none does
    fits: bool
    filled: int = 0  # requests per arm once the test takes what the budget leaves (AbFill); 0: not extended


def plan_demo(
    rows: list[CycleRow],
    elapsed_s: float,
    cycles: int,
    budget_s: float,
    per_arm: int,
    params: Params,
    max_per_arm: int = 0,
) -> DemoPlan:
    """The plan after the first cycle (rows[0]): the predicted wall time of `cycles` cycles and an A/B test of
    per_arm requests per arm, and, when that is over budget_s, the most cycles that are not. A single cycle counts
    only when it promoted a candidate on the gate (else there is nothing to A/B test). max_per_arm > 0: a plan that
    fits extends the test with what the budget leaves, up to max_per_arm (AbFill), and predicts that wall time."""
    pace = measured_pace(rows[:1], params)
    total = predicted_s(pace, elapsed_s, len(rows), cycles, per_arm, params)
    fitting = [
        k
        for k in range(len(rows), cycles)
        if predicted_s(pace, elapsed_s, len(rows), k, per_arm, params) <= budget_s
        and (k > 1 or rows[0].cycle_status == "deployed")
    ]
    plan = DemoPlan(pace, cycles, per_arm, total, budget_s, max(fitting, default=None), total <= budget_s)
    if not (plan.fits and max_per_arm > per_arm):
        return plan
    spare_s = budget_s - total  # the planned test's requests take their time in `total` already
    filled = min(max_per_arm, per_arm + int(spare_s * pace.traffic_rps / 2))
    return replace(plan, filled=filled, predicted_s=predicted_s(pace, elapsed_s, len(rows), cycles, filled, params))


def describe_plan(plan: DemoPlan, mde: float, power: float) -> list[str]:
    """The plan in words, as the demo prints it."""
    p = plan.pace
    lines = [
        f"Pace on this machine (cycle 1): {p.traffic_rps:.1f} decided requests/s through the gateway; a cycle "
        f"{p.cycle_s / 60:.1f} min (training {p.train_s:.0f} s), the gate typing {p.gate_rps:.1f} requests/s.",
        f"Plan: {plan.cycles} cycles, an A/B test of {plan.per_arm} requests per arm ({power:.0%} power at a reward "
        f"difference of {mde})"
        + (
            f", extended with what the budget leaves (to about {plan.filled} per arm at cycle 1's pace; the test "
            "measures its own)"
            if plan.filled > plan.per_arm
            else ""
        )
        + f", the closing table: about {plan.predicted_s / 60:.1f} min in all (budget {plan.budget_s / 60:.1f} min).",
    ]
    if not plan.fits:
        lines.append(
            f"This machine cannot run {plan.cycles} cycles and an A/B test that can decide within "
            f"{plan.budget_s / 60:.1f} min. Choose: a longer run (--budget-min {math.ceil(plan.predicted_s / 60)}), "
            + (
                f"fewer cycles (--cycles {plan.fewer_cycles}), "
                if plan.fewer_cycles
                else "fewer cycles (none fits the budget), "
            )
            + "or the A/B test capped to the budget, which may not decide (--if-short cap)."
        )
    return lines


@dataclass(frozen=True)
class Probe:
    """One short online cycle on this machine (`probe_cycle`), timed: what `tabrl doctor --predict` scales."""

    row: CycleRow  # the probe cycle: its traffic, training and gate timed
    requests: int  # the simulated requests it sent
    gate_requests: int  # evaluate.n_requests its gate typed per model
    startup_s: float  # the rest of its wall time: the state, the gateway, Prefect's and MLflow's first calls, the end


def probe_cycle(params_file: str, overrides: list[str], requests: int, users: int, seed: int = 0) -> Probe:
    """One online cycle of `requests` simulated requests whose gate types as many per model (its judged FIM samples
    cut in the same proportion), in a state dir of its own that is removed after: the same code path as a cycle
    of `make demo` or `bench.learning`, at a size that takes a minute or two."""
    params = load_params(params_file, overrides)
    samples = max(1, round(params.evaluate.n_samples * requests / params.evaluate.n_requests))
    sized = [*overrides, f"evaluate.n_requests={requests}", f"evaluate.n_samples={samples}"]
    with tempfile.TemporaryDirectory(prefix="tabrl-probe-") as state:
        started = time.perf_counter()
        rows, _ = run_online_loop(params_file, sized, 1, requests, users, Path(state), seed=seed, ab_test=False)
        total_s = time.perf_counter() - started
    row = rows[0]
    startup_s = total_s - cycle_wall_s(row, params)
    return Probe(row, requests, requests, max(startup_s, 0.0))


def scaled(probe: Probe, requests: int, gate_requests: int) -> CycleRow:
    """The probe's cycle at `requests` simulated requests and gates of `gate_requests` per model: traffic and
    training in proportion to the requests (training's steps follow the decided rows), the gate's typing to its
    requests (its engines, judge and logging as measured), the rest of the cycle (ingest, registry, rollout) as
    measured."""
    r, g = requests / probe.requests, gate_requests / probe.gate_requests
    row = probe.row
    train_s, evaluate_s = row.train_s * r, row.evaluate_s + row.typing_s * (g - 1)
    return replace(
        row,
        requests=round(row.requests * r),
        traffic_s=row.traffic_s * r,
        train_s=train_s,
        evaluate_s=evaluate_s,
        typing_s=row.typing_s * g,
        cycle_s=row.cycle_s + (train_s - row.train_s) + (evaluate_s - row.evaluate_s),
    )


def cycle_wall_s(row: CycleRow, params: Params) -> float:
    """A cycle's wall time: its traffic, the feedback timeout, the cycle flow."""
    return row.traffic_s + params.ingest.feedback_timeout_s + 0.5 + row.cycle_s


def predict_demo(
    probe: Probe,
    params: Params,
    cycles: int,
    requests: int,
    budget_s: float,
    mde: float,
    power: float,
    max_per_arm: int = 0,
) -> tuple[DemoPlan, DemoPlan]:
    """What the demo's plan after cycle 1 will say on this machine, from the probe, and the plan it will run
    unattended (`unattended`): its cycle 1 at full size (`scaled`, gates of evaluate.n_requests), the A/B test's
    size from the probe's reward sd, the predicted wall time (the probe's startup included). Cycle 1's gate outcome
    is not known ahead, so the fewer cycles are never one (a single cycle counts only when its gate passed).
    max_per_arm > 0: the demo extends its test with what the budget leaves (`plan_demo`)."""
    row = replace(scaled(probe, requests, params.evaluate.n_requests), cycle_status="unknown")
    needed = plan_ab(base_reward_sd(row, params), mde, params.deploy.alpha, power, 10**9)
    elapsed = probe.startup_s + cycle_wall_s(row, params)
    asked = plan_demo([row], elapsed, cycles, budget_s, needed.per_arm, params, max_per_arm)
    cycles, budget_s = unattended(asked)
    return asked, plan_demo([row], elapsed, cycles, budget_s, needed.per_arm, params, max_per_arm)


def unattended(plan: DemoPlan) -> tuple[int, float]:
    """(cycles, budget_s) the demo runs when nobody is asked (no terminal, or --if-short fewer-cycles) and the plan
    does not fit: fewer cycles where some fit, else the budget raised to the predicted wall time."""
    if plan.fits:
        return plan.cycles, plan.budget_s
    if plan.fewer_cycles:
        return plan.fewer_cycles, plan.budget_s
    return plan.cycles, 60.0 * math.ceil(plan.predicted_s / 60)
