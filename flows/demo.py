"""`make demo`: online RL cycles, one live A/B test sized to decide, the closing table: about 14 min on 2 cores.

    python -m flows.demo --seed 0                 # what `make demo` runs
    python -m flows.demo --cycles 2 --requests 200 --max-per-arm 300   # a quicker, less decisive look

Three parts, all on the real gateway, log store, Prefect flows and MLflow registry (state in --state):

1. Gated cycles. Simulated users type train files through the gateway; each cycle trains on their outcomes, and
   a candidate that passes the gate (held-out evaluation) is promoted at once, without an A/B test. One cycle's
   gain is small, and an A/B test per cycle would need thousands of requests per arm to see it.
2. One A/B test that can decide. The base model comes back as champion, the final model of part 1 is the
   challenger, and live traffic is split between them. Its size is planned before it starts (a two-sided test at
   deploy.alpha with --power to find a reward difference of --mde, sd measured on cycle 1's traffic), capped at
   what the cycles left of the --budget-min wall time, and the decision flow looks once, at the end: repeated
   looks would inflate alpha (tasks/deploy/ab.py). It promotes the challenger on live evidence, or rolls it back.
3. The closing table: base vs the final champion on held-out requests no gate typed, with 95 % intervals, and in
   words where an interval includes 0. When the A/B test rolled the final model back (the base is champion again),
   the table shows base vs that rolled-back model, named so.

Writes STATE/demo.json (the cycles, the A/B test, the story, wall times), STATE/cycles.png and the MLflow runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow
from scipy.stats import norm

from flows.ab_decision import ab_decision
from flows.loop_state import CycleRow
from flows.online_loop import champion_dir, cycle_regions, loop_overrides, run_online_loop, start_gateway
from flows.report import print_report, print_story, print_ui_pointers
from serving.router import assign
from serving.simulate import run_simulation
from tasks.core.config import DEFAULT_PARAMS_FILE, Params, load_params
from tasks.core.outcomes import ArmCounts, reward_std
from tasks.core.procs import exit_on_sigterm, free_port
from tasks.core.store import CHALLENGER, CHAMPION, open_store, read_arms
from tasks.deploy.ab import arm_stats
from tasks.deploy.arms import serve_champion
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.sim.editor import read_regions, regions_path
from tasks.sim.users import SimUser, make_users

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
    z_alpha = norm.ppf(1 - alpha / 2)
    z = z_alpha + norm.ppf(power)
    needed = math.ceil(2 * z * z * reward_sd * reward_sd / (mde * mde))
    per_arm = min(needed, max_per_arm)
    power_at_n = float(norm.cdf(math.sqrt(per_arm / 2) * mde / reward_sd - z_alpha))
    return AbPlan(per_arm, needed, reward_sd, mde, power, alpha, power_at_n)


def budget_per_arm(rows: list[CycleRow], elapsed_s: float, budget_s: float, params: Params) -> int:
    """Requests per arm the A/B test can serve in what budget_s leaves after elapsed_s: the cycles' traffic rate
    through the gateway, less the closing table (2 x CLOSING_REQUESTS typed at the gates' pace, their judged
    samples included, so a little over) and the test's fixed costs (rollout, gateway, the feedback timeout, the
    decision). It depends on wall times only, never on outcomes, so the one look keeps its alpha; at least
    MIN_PER_ARM."""
    served = [r for r in rows if r.traffic_s > 0]
    gated = [r for r in rows if r.evaluate_s > 0]
    if not served or not gated:
        return MIN_PER_ARM
    rate = sum(r.requests for r in served) / sum(r.traffic_s for r in served)
    gate_rate = 2 * params.evaluate.n_requests * len(gated) / sum(r.evaluate_s for r in gated)
    left = budget_s - elapsed_s - 2 * CLOSING_REQUESTS / gate_rate - AB_FIXED_S - params.ingest.feedback_timeout_s
    return max(int(left * rate / 2), MIN_PER_ARM)


def base_reward_sd(row: CycleRow, params: Params) -> float:
    """The per-request reward sd of a cycle's online traffic (cycle 1: the base model serves all of it)."""
    shown = round(row.requests * row.suggest_rate)
    accepted = round(shown * row.accept_rate)
    counts = ArmCounts(accepted=accepted, rejected=shown - accepted, abstained=row.requests - shown, accepted_chars=0)
    return reward_std(counts, params.reward)  # characters play no part in it


@flow(name="demo-start-ab-test", log_prints=True)
def start_ab_test(params_file: str, overrides: list[str], base_label: str) -> str:
    """The base back as the one champion arm, the current champion rolled out as challenger; its label."""
    params = load_params(params_file, overrides)
    registry = Registry(params)
    final = registry.aliased(CHAMPION)
    base = registry.version_of(f"models:/{base_label}")
    if final is None or final.version == base.version:
        raise ValueError("no candidate was promoted: there is nothing to A/B test against the base")
    registry.set_alias(CHAMPION, base.version)
    serve_champion(params)
    base_dir = resolve_model_dir(registry.base_of(final).uri, params)
    rollout(final, str(resolve_model_dir(final.uri, params)), params, str(base_dir))
    print(f"A/B test: champion {base.label} (the base) vs challenger {final.label} (the final model)")
    return final.label


def run_ab_test(
    params_file: str, overrides: list[str], state: Path, plan: AbPlan, users: int, seed: int, typed_regions: int
) -> dict:
    """Live traffic until each arm has about plan.per_arm requests, the feedback timeout, then one decision.
    typed_regions: the train regions the cycles offered (the first ones); the test's traffic types the others, so
    the challenger is never tested on code it was trained on."""
    params = load_params(params_file, overrides)
    regions = read_regions(regions_path(params.paths.data_dir, "train"))[typed_regions:]
    if not regions:
        raise ValueError(f"the cycles offered all {typed_regions} train regions: none is left for the A/B test")
    port = free_port()
    gateway = start_gateway(params_file, overrides, port, state / "gateway-ab.log")
    try:
        started = time.perf_counter()
        by_arm = _traffic_until_planned(f"http://127.0.0.1:{port}", regions, plan, users, seed, params)
        traffic_s = time.perf_counter() - started
        time.sleep(params.ingest.feedback_timeout_s + 0.5)  # every shown suggestion has its outcome
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    with open_store(params.paths.database_url) as engine:
        looked_at = min(s.requests for s in arm_stats(engine, params).values())
    # One look at the planned n: no early looks to guard against (min_samples 1), and max_samples = what each arm
    # has, so that a difference the test cannot show ends in a rollback (inconclusive) rather than "continue".
    one_look = ["deploy.min_samples=1", f"deploy.max_samples={looked_at}"]
    decision = ab_decision(params_file, [*overrides, *one_look])
    return {
        "plan": asdict(plan),
        "requests": dict(sorted(by_arm.items())),
        "traffic_s": traffic_s,
        "action": decision.action,
        "reason": decision.reason,
        "numbers": decision.numbers,
    }


def _traffic_until_planned(
    url: str, regions: list, plan: AbPlan, users: int, seed: int, params: Params
) -> dict[str, int]:
    """Requests per arm after live traffic from the far end of `regions` (train regions no cycle offered) until
    each arm has plan.per_arm. Half the users are on each arm (`_users_per_arm`), but users type at their own
    pace, so a first round of 2 x plan.per_arm can leave an arm short; the next rounds top it up with that arm's
    users only, typing further regions, as many more requests as the arm's share of never-shown ones (cancelled,
    not shown: no request of the test) says it needs. When to stop depends on counts only, never on outcomes, so
    the one look at the end keeps its alpha."""
    sim_users, arm_of = _users_per_arm(users, params, seed)
    served: dict[str, int] = {}  # decided requests per arm
    logged: dict[str, int] = {}  # completions per arm, never-shown ones included
    typing, total = sim_users, 2 * plan.per_arm
    width = min(max(users, total // 4), len(regions))  # regions per round
    for round_ in range(4):
        end = len(regions) - (round_ * width) % len(regions)  # rounds walk back from the end, wrapping
        window = regions[max(end - width, 0) : end]
        by_arm = run_simulation(
            url,
            window,
            typing,
            total,
            None,
            concurrency=4,
            seed=seed * 1000 + 999 + round_,
            traffic=params.traffic,
            simulator=params.simulator,
        )
        for arm, summary in by_arm.items():
            served[arm] = served.get(arm, 0) + summary.requests
            logged[arm] = logged.get(arm, 0) + summary.logged
        shorter = min((CHAMPION, CHALLENGER), key=lambda arm: served.get(arm, 0))
        missing = plan.per_arm - served.get(shorter, 0)
        total = math.ceil(missing * logged.get(shorter, 1) / max(served.get(shorter, 0), 1))
        if missing <= 0:
            break
        typing = [u for u in sim_users if arm_of[u.user_id] == shorter]
        print(f"A/B traffic: {served}; {total} more requests from the {shorter} arm's {len(typing)} users", flush=True)
    return served


def _users_per_arm(users: int, params: Params, seed: int) -> tuple[list[SimUser], dict[str, str]]:
    """`users` simulated users, half on each arm by the gateway's sticky assignment (`serving.router.assign`), and
    each one's arm: drawn in order from a larger pool, so the arms' traffic is balanced (equal arms give the test
    its best power) and neither arm's users depend on the test's outcomes."""
    if users < 2:
        raise ValueError(f"--ab-users {users}: an A/B test needs at least one user on each arm")
    with open_store(params.paths.database_url) as engine:
        arms = read_arms(engine)
    pool = make_users(8 * users, params.simulator, prefix=f"ab{seed}")
    arm_of = {u.user_id: assign(u.user_id, params.serving.experiment_salt, arms).name for u in pool}
    per_arm = {arm: [u for u in pool if arm_of[u.user_id] == arm][: users // 2] for arm in (CHAMPION, CHALLENGER)}
    if min(len(v) for v in per_arm.values()) < users // 2:
        raise ValueError(f"too few of {len(pool)} simulated users fall on an arm: check deploy.challenger_share")
    return per_arm[CHAMPION] + per_arm[CHALLENGER], arm_of


def print_ab(ab: dict) -> None:
    from rich.table import Table

    from flows.cli.console import console, print_table

    n = ab["numbers"]
    plan = ab["plan"]
    table = Table(
        title=f"Live A/B test, looked at once: base (champion) vs final model (challenger); planned "
        f"{plan['per_arm']} requests per arm (power {plan['power']:.0%} for a reward difference of "
        f"{plan['mde']} at alpha {plan['alpha']}, reward sd {plan['reward_sd']:.3f}"
        + (
            f"; {plan['needed']} asked for, capped to fit the time: power {plan['power_at_n']:.0%}"
            if plan["needed"] > plan["per_arm"]
            else ""
        )
        + ")"
    )
    for col in ("arm", "requests", "shown", "accept/shown", "reward/request", "accepted chars/request"):
        table.add_column(col, justify="right")
    for arm in (CHAMPION, CHALLENGER):
        if f"{arm}_requests" in n:
            table.add_row(
                arm,
                f"{n[f'{arm}_requests']:.0f}",
                f"{n[f'{arm}_shown']:.0f}",
                f"{n[f'{arm}_accept_rate']:.3f}",
                f"{n[f'{arm}_reward_per_request']:.4f}",
                f"{n[f'{arm}_chars_per_request']:.2f}",
            )
    print_table(table)
    verdict = "PROMOTED on live A/B evidence" if ab["action"] == "promote" else "ROLLED BACK"
    console.print(f"{verdict}: {ab['reason']}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    exit_on_sigterm()  # a `kill` stops the gateway the demo started, too
    started = time.perf_counter()
    overrides = [*DEMO_SETTINGS, *args.set]
    rows, params = run_online_loop(
        args.params, overrides, args.cycles, args.requests, args.users, args.state, seed=args.seed, ab_test=False
    )
    print_report(rows, args.state, params, promoted_on_gate=True)
    gated_s = time.perf_counter() - started
    full = loop_overrides(overrides, args.state, args.seed)  # the loop's own state paths
    base_label = f"{params.deploy.registered_model}/1"  # a fresh state's registry starts with the base
    ab: dict = {"action": "none", "reason": "no candidate passed the gate"}
    registry = Registry(params)
    final = registry.aliased(CHAMPION)
    final_dir = champion_dir(params)  # the cycles' final model: the closing table's subject, whatever the A/B says
    if final is not None and final.version != registry.version_of(f"models:/{base_label}").version:
        cap = args.max_per_arm
        if args.budget_min > 0:  # what the cycles left of the wall-time budget
            cap = min(cap, budget_per_arm(rows, time.perf_counter() - started, 60 * args.budget_min, params))
        plan = plan_ab(base_reward_sd(rows[0], params), args.mde, params.deploy.alpha, args.power, cap)
        ab["challenger"] = start_ab_test(args.params, full, base_label)
        offered = args.cycles * cycle_regions(args.users, args.requests)  # the cycles' train regions, typed first
        ab |= run_ab_test(args.params, full, args.state, plan, args.ab_users, args.seed, offered)
        print_ab(ab)
    else:
        print(f"no candidate passed the gate in {args.cycles} cycles: there is no A/B test to run", flush=True)
    ab_s = time.perf_counter() - started - gated_s
    closing = load_params(args.params, [*full, f"evaluate.n_requests={CLOSING_REQUESTS}"])
    # Promoted: the final model is the champion. Rolled back: the base is the champion again, and the table still
    # shows what the rolled-back model does on held-out requests (base vs base would say nothing).
    if ab["action"] == "rollback":
        print("The live A/B test rolled the final model back: the champion is the base again.", flush=True)
    name = "final champion" if ab["action"] in ("promote", "none") else "final model (rolled back)"
    story = print_story(Path(closing.model.base_dir), final_dir, args.state, closing, final=name)
    print_ui_pointers(params)
    times = {"gated_cycles_s": gated_s, "ab_test_s": ab_s, "total_s": time.perf_counter() - started}
    record = {"seed": args.seed, "cycles": [asdict(r) for r in rows], "ab": ab, "closing_model": name}
    record |= {"story": story, "times_s": times}
    (args.state / "demo.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"demo done in {times['total_s'] / 60:.1f} min; record: {args.state / 'demo.json'}", flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default=str(DEFAULT_PARAMS_FILE), help="params.yaml to read")
    p.add_argument("--set", action="append", default=[], help="override one key: section.key=value")
    p.add_argument("--seed", type=int, default=0, help="seed of users, traffic and training")
    p.add_argument("--cycles", type=int, default=4, help="gated online RL cycles")
    p.add_argument("--requests", type=int, default=1000, help="simulated completion requests per cycle")
    p.add_argument("--users", type=int, default=24, help="simulated users during the cycles")
    p.add_argument("--mde", type=float, default=0.014, help="reward-per-request difference the A/B test is sized for")
    p.add_argument("--power", type=float, default=0.8, help="power of the A/B test at --mde")
    p.add_argument("--max-per-arm", type=int, default=4000, help="cap on the A/B test's requests per arm")
    p.add_argument(
        "--budget-min",
        type=float,
        default=14.5,
        help="wall-time budget of the whole demo in minutes: the A/B test is capped at what the cycles leave of it "
        "(at the cycles' traffic rate, the closing table set aside); 0: no cap but --max-per-arm",
    )
    p.add_argument("--ab-users", type=int, default=96, help="simulated users during the A/B test")
    p.add_argument("--state", type=Path, default=Path("state/demo"), help="state dir (wiped at start)")
    return p


if __name__ == "__main__":
    sys.exit(main())
