"""`make demo`: online RL cycles, one live A/B test sized to decide, the closing table, in --budget-min (14.5).

    python -m flows.demo --seed 0                 # what `make demo` runs
    python -m flows.demo --cycles 2 --requests 200 --max-per-arm 300   # a quicker, less decisive look
    python -m flows.demo --replay --cycles 2 --requests 200 --max-per-arm 300   # the same demo.json every run

Three parts, all on the real gateway, log store, Prefect flows and MLflow registry (state in --state). After the
first cycle the demo prints this machine's pace (decided requests/s through the gateway, a cycle's minutes) and its
plan with the predicted wall time (`flows/demo_plan.py`); where the planned cycles and an A/B test that can decide
do not fit --budget-min, it says so and takes --if-short's choice: fewer cycles, a longer run, or a capped test.

1. Gated cycles. Simulated users type train files through the gateway; each cycle trains on their outcomes, and
   a candidate that passes the gate (held-out evaluation) is promoted at once, without an A/B test. One cycle's
   gain is small, and an A/B test per cycle would need thousands of requests per arm to see it. When the planned
   cycles end with no candidate, the demo runs another while the budget still has room for it and a test.
2. One A/B test that can decide. The base model comes back as champion, the final model of part 1 is the
   challenger, and live traffic is split between them. Its size is planned before it starts (a two-sided test at
   deploy.alpha with --power to find a reward difference of --mde, sd measured on cycle 1's traffic), capped at
   what the cycles left of the --budget-min wall time, and extended with what they leave beyond it (--ab-fill, up to
   --max-per-arm: the gains one demo learns are often below --mde). The decision flow looks once, at the end:
   repeated looks would inflate alpha (tasks/deploy/ab.py). It promotes the challenger on live evidence, or rolls
   it back. Wall time alone sizes the test, never its outcomes.
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
from dataclasses import asdict, replace
from pathlib import Path

from prefect import flow

from flows.ab_decision import ab_decision
from flows.demo_plan import (
    CLOSING_REQUESTS,
    DEMO_SETTINGS,
    AbFill,
    AbPlan,
    DemoPlan,
    ab_traffic_left_s,
    another_cycle_fits,
    base_reward_sd,
    budget_per_arm,
    describe_plan,
    plan_ab,
    plan_demo,
    power_at,
    unattended,
)
from flows.loop_state import CycleRow
from flows.online_loop import champion_dir, cycle_regions, loop_overrides, run_online_loop, start_gateway
from flows.report import print_ab, print_report, print_story, print_ui_pointers
from serving.router import assign
from serving.simulate import run_simulation
from tasks.core.config import DEFAULT_PARAMS_FILE, Params, load_params
from tasks.core.procs import exit_on_sigterm, free_port
from tasks.core.store import CHALLENGER, CHAMPION, open_store, read_arms
from tasks.core.teams import ORG
from tasks.deploy.ab import arm_stats
from tasks.deploy.arms import serve_champion
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.sim.editor import read_regions, regions_path
from tasks.sim.users import SimUser, make_users

_AB_ROUNDS = 8  # rounds of A/B traffic at most: the first, then top-ups of the shorter arm


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
    params_file: str,
    overrides: list[str],
    state: Path,
    plan: AbPlan,
    users: int,
    seed: int,
    typed_regions: int,
    fill: AbFill | None = None,
) -> dict:
    """Live traffic until each arm has about plan.per_arm requests (more, to fill.until, with `fill`), the feedback
    timeout, then one decision. typed_regions: the train regions the cycles offered (the first ones); the test's
    traffic types the others, so the challenger is never tested on code it was trained on."""
    params = load_params(params_file, overrides)
    regions = read_regions(regions_path(params.paths.data_dir, "train"))[typed_regions:]
    if not regions:
        raise ValueError(f"the cycles offered all {typed_regions} train regions: none is left for the A/B test")
    port = free_port()
    gateway = start_gateway(params_file, overrides, port, state / "gateway-ab.log")
    try:
        started = time.perf_counter()
        by_arm, target = _traffic_until_planned(f"http://127.0.0.1:{port}", regions, plan, users, seed, params, fill)
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
    decision = ab_decision(params_file, [*overrides, *one_look], ORG)[ORG]
    return {
        "plan": asdict(plan),
        "ran_to": target,  # requests per arm the traffic ran to: plan.per_arm, or more with what the budget left
        "ran_to_power": [(d, power_at(target, plan.reward_sd, d, plan.alpha)) for d in (plan.mde, plan.mde * 2 / 3)],
        "requests": dict(sorted(by_arm.items())),
        "traffic_s": traffic_s,
        "action": decision.action,
        "reason": decision.reason,
        "numbers": decision.numbers,
    }


def _traffic_until_planned(
    url: str, regions: list, plan: AbPlan, users: int, seed: int, params: Params, fill: AbFill | None = None
) -> tuple[dict[str, int], int]:
    """Requests per arm after live traffic from the far end of `regions` (train regions no cycle offered) until
    each arm has plan.per_arm (or, with `fill`, what fill.target sets after the first round), and that target.
    Half the users are on each arm (`_users_per_arm`), but users type at their own pace, so a round can leave an
    arm short; the next rounds top up the short arms with their users only, typing further regions, as many more
    requests as each arm's share of never-shown ones (cancelled, not shown: no request of the test) says it needs.
    When to stop depends on counts and wall time only, never on outcomes, so the one look at the end keeps its
    alpha."""
    sim_users, arm_of = _users_per_arm(users, params, seed)
    served: dict[str, int] = {}  # decided requests per arm
    logged: dict[str, int] = {}  # completions per arm, never-shown ones included
    target, typing, total, end = plan.per_arm, sim_users, 2 * plan.per_arm, len(regions)
    for round_ in range(_AB_ROUNDS):
        width = min(max(len(typing), total // 4), len(regions))  # regions this round: rounds walk back, wrapping
        end = end if end - width >= 0 else len(regions)
        window, end = regions[end - width : end], end - width
        began = time.perf_counter()
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
        if round_ == 0 and fill is not None:
            target = fill.target(served, time.perf_counter() - began, plan.per_arm)
        short = {arm: target - served.get(arm, 0) for arm in (CHAMPION, CHALLENGER) if served.get(arm, 0) < target}
        if not short:
            break
        typing = [u for u in sim_users if arm_of[u.user_id] in short]
        needs = [math.ceil(n * logged.get(arm, 1) / max(served.get(arm, 0), 1)) for arm, n in short.items()]
        # at least one request per typing user: a top-up of 2 can be cancelled whole by an editor that aborts
        total = max(sum(needs), len(typing))
        print(f"A/B traffic: {served}, to {target} per arm; {total} more requests from {sorted(short)}", flush=True)
    else:
        print(f"A/B traffic: {served} after {_AB_ROUNDS} rounds; the test looks at what the shorter arm has")
    return served, target


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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    exit_on_sigterm()  # a `kill` stops the gateway the demo started, too
    started = time.perf_counter()
    overrides = _overrides(args)
    planned: list[DemoPlan] = []

    def after_cycle(rows: list[CycleRow]) -> int:
        """After cycle 1: the plan from this machine's pace, and what to do when it does not fit the budget."""
        if len(rows) == 1 and args.budget_min > 0:
            params = load_params(args.params, overrides)
            needed = plan_ab(base_reward_sd(rows[0], params), args.mde, params.deploy.alpha, args.power, 10**9)
            elapsed = time.perf_counter() - started
            fill = args.max_per_arm if args.ab_fill else 0
            plan = plan_demo(rows, elapsed, args.cycles, 60 * args.budget_min, needed.per_arm, params, fill)
            planned.append(plan)
            for line in describe_plan(plan, args.mde, args.power):
                print(line, flush=True)
            if not plan.fits:
                args.cycles, args.budget_min = choose(plan, args.if_short, args.cycles, args.budget_min)
                chosen = plan_demo(rows, elapsed, args.cycles, 60 * args.budget_min, needed.per_arm, params, fill)
                planned.append(chosen)  # what runs: its predicted wall time is the one to check
                print(f"Predicted: {chosen.predicted_s / 60:.1f} min.", flush=True)
        elif len(rows) == args.cycles and args.budget_min > 0:
            args.cycles += _one_more_cycle(rows, time.perf_counter() - started, args, overrides)
        return args.cycles

    rows, params = run_online_loop(
        args.params,
        overrides,
        args.cycles,
        args.requests,
        args.users,
        args.state,
        seed=args.seed,
        ab_test=False,
        after_cycle=after_cycle,
    )
    print_report(rows, args.state, params, promoted_on_gate=True)
    gated_s = time.perf_counter() - started
    full = loop_overrides(overrides, args.state, args.seed)  # the loop's own state paths
    final_dir = champion_dir(params)  # the cycles' final model: the closing table's subject, whatever the A/B says
    ab = final_ab_test(args, rows, params, full, time.perf_counter() - started)
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
    record |= {"plan": [asdict(p) for p in planned], "budget_min": args.budget_min}
    record |= {"story": story, "times_s": times}
    (args.state / "demo.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    predicted = f" (predicted after cycle 1: {planned[-1].predicted_s / 60:.1f})" if planned else ""
    print(f"demo done in {times['total_s'] / 60:.1f} min{predicted}; record: {args.state / 'demo.json'}", flush=True)
    return 0


def _overrides(args: argparse.Namespace) -> list[str]:
    """The demo's settings and --set's; with --replay, what makes a run replay, and no wall-time budget or fill."""
    if not args.replay:
        return [*DEMO_SETTINGS, *args.set]
    args.budget_min, args.ab_fill = 0.0, False
    return [*DEMO_SETTINGS, *args.set, "simulator.client=waits", "simulator.replay=true"]


def _one_more_cycle(rows: list[CycleRow], elapsed_s: float, args: argparse.Namespace, overrides: list[str]) -> int:
    """1 when the planned cycles ended with no candidate and the budget has room for one more and an A/B test (the
    time kept for the test would go unused), else 0. The gates' outcomes decide it, never the test's: its alpha is
    kept."""
    if any(r.cycle_status == "deployed" for r in rows):
        return 0
    if not another_cycle_fits(rows, elapsed_s, 60 * args.budget_min, load_params(args.params, overrides)):
        return 0
    print(
        f"No candidate passed the gate in {len(rows)} cycles, and the budget has room for one more cycle and an A/B "
        f"test: running cycle {len(rows) + 1}.",
        flush=True,
    )
    return 1


def final_ab_test(args: argparse.Namespace, rows: list[CycleRow], params: Params, full: list[str], elapsed_s: float):
    """Part 2: the base against the cycles' final model, sized by the power plan and capped at what the budget
    leaves; {"action": "none", ...} when no cycle promoted a candidate."""
    base_label = f"{params.deploy.registered_model}/1"  # a fresh state's registry starts with the base
    registry = Registry(params)
    final = registry.aliased(CHAMPION)
    if final is None or final.version == registry.version_of(f"models:/{base_label}").version:
        print(f"no candidate passed the gate in {len(rows)} cycles: there is no A/B test to run", flush=True)
        return {"action": "none", "reason": "no candidate passed the gate"}
    cap, fill = args.max_per_arm, None
    if args.budget_min > 0:  # what the cycles left of the wall-time budget
        cap = min(cap, budget_per_arm(rows, elapsed_s, 60 * args.budget_min, params))
        left_s = ab_traffic_left_s(rows, elapsed_s, 60 * args.budget_min, params)
        fill = AbFill(time.perf_counter() + left_s, args.max_per_arm) if args.ab_fill else None
    plan = plan_ab(base_reward_sd(rows[0], params), args.mde, params.deploy.alpha, args.power, cap)
    ab = {"challenger": start_ab_test(args.params, full, base_label)}
    offered = len(rows) * cycle_regions(args.users, args.requests)  # the cycles' train regions, typed first
    ab |= run_ab_test(args.params, full, args.state, plan, args.ab_users, args.seed, offered, fill)
    print_ab(ab)
    return ab


IF_SHORT = ("ask", "fewer-cycles", "longer", "cap")


def choose(plan: DemoPlan, if_short: str, cycles: int, budget_min: float) -> tuple[int, float]:
    """(cycles, budget_min) when the plan does not fit: --if-short's choice; `ask` asks on a terminal, and
    elsewhere takes fewer cycles where some fit, else the longer run (both end in an A/B test that can decide)."""
    if if_short == "ask" and sys.stdin.isatty():
        options = "[l]onger" + (", [f]ewer cycles" if plan.fewer_cycles else "") + " or [c]ap the A/B test"
        answer = input(f"{options}? ").strip().lower()[:1]
        if_short = {"l": "longer", "f": "fewer-cycles", "c": "cap"}.get(answer, "ask")
    if if_short == "cap":
        print("Keeping the budget: the A/B test is capped to what is left of it and may not decide.", flush=True)
        return cycles, budget_min
    if if_short == "longer":
        plan = replace(plan, fewer_cycles=None)
    runs, budget_s = unattended(plan)
    if runs < cycles:
        print(f"Running {runs} cycles, so that the A/B test can decide within the budget.", flush=True)
    else:
        print(f"Running longer: a budget of {budget_s / 60:.0f} min, so that the A/B test can decide.", flush=True)
    return runs, budget_s / 60


def defaults() -> argparse.Namespace:
    """The demo's arguments as `make demo` runs it (what `tabrl doctor --predict demo` predicts)."""
    return _parser().parse_args([])


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
        "--ab-fill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="extend the A/B test past its planned size with what --budget-min leaves, up to --max-per-arm (wall "
        "time decides how far, never the outcomes): more power at the small gains one demo learns",
    )
    p.add_argument(
        "--budget-min",
        type=float,
        default=14.5,
        help="wall-time budget of the whole demo in minutes: the A/B test is capped at what the cycles leave of it "
        "(at the cycles' traffic rate, the closing table set aside); 0: no cap but --max-per-arm",
    )
    p.add_argument(
        "--if-short",
        choices=IF_SHORT,
        default="ask",
        help="when the plan made after cycle 1 (this machine's pace) cannot fit the cycles and an A/B test that can "
        "decide within --budget-min: ask (on a terminal; elsewhere fewer cycles where some fit, else longer), "
        "fewer-cycles, longer (raise the budget to the predicted time) or cap (the A/B test capped: may not decide)",
    )
    p.add_argument("--ab-users", type=int, default=96, help="simulated users during the A/B test")
    p.add_argument(
        "--replay",
        action="store_true",
        help="a run that replays, to check that a change keeps behaviour: on one machine the same demo.json each time "
        "but for wall times (unless the machine is so loaded that a Tab comes later than the 10-s outcome window). "
        "Editors wait for every answer, each user asks a fixed share of seeded requests (simulator.replay), and "
        "nothing follows the wall clock (--budget-min 0, --no-ab-fill)",
    )
    p.add_argument("--state", type=Path, default=Path("state/demo"), help="state dir (wiped at start)")
    return p


if __name__ == "__main__":
    sys.exit(main())
