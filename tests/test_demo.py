"""The demo (flows/demo.py): an A/B test sized before it starts, looked at once, and a closing story told in words."""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import replace

import pytest
import yaml

from flows.demo import _one_more_cycle, _overrides, _parser, choose, defaults, run_ab_test, start_ab_test
from flows.demo_plan import (
    AbFill,
    AbPlan,
    Probe,
    ab_traffic_left_s,
    another_cycle_fits,
    base_reward_sd,
    budget_per_arm,
    cycle_wall_s,
    measured_pace,
    plan_ab,
    plan_demo,
    predict_demo,
    predicted_s,
    probe_cycle,
    scaled,
    unattended,
)
from flows.loop_state import CycleRow
from flows.report import story_in_words
from tasks.core.config import load_params
from tasks.core.store import CHALLENGER, CHAMPION, open_store, read_arms
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import CycleRuns
from tasks.sim.editor import regions_path, write_regions
from tests.conftest import tiny_params
from tests.test_flow_cycle import FAST_TRAIN, write_cycle_inputs


def test_the_plan_is_the_two_sided_power_formula():
    # 2 (1.95996 + 0.84162)^2 0.17^2 / 0.024^2 = 787.6 -> 788 requests per arm
    plan = plan_ab(reward_sd=0.17, mde=0.024, alpha=0.05, power=0.8, max_per_arm=5000)
    assert (plan.per_arm, plan.needed) == (788, 788)
    # twice the sd needs four times the requests; halving the difference too
    assert plan_ab(0.34, 0.024, 0.05, 0.8, 10**6).needed == pytest.approx(4 * 788, abs=4)
    assert plan_ab(0.17, 0.012, 0.05, 0.8, 10**6).needed == pytest.approx(4 * 788, abs=4)


def test_a_capped_plan_says_what_it_was_asked_for_and_the_power_it_keeps():
    plan = plan_ab(reward_sd=0.17, mde=0.01, alpha=0.05, power=0.8, max_per_arm=1500)
    assert plan.per_arm == 1500 and plan.needed > 4000
    # 1500 per arm: z = sqrt(750) 0.01 / 0.17 - 1.96 = -0.349 -> power 36 %; uncapped, the power asked for
    assert plan.power_at_n == pytest.approx(0.3635, abs=1e-3)
    assert plan_ab(0.17, 0.024, 0.05, 0.8, 5000).power_at_n == pytest.approx(0.8, abs=2e-3)


def test_the_ab_test_gets_what_the_cycles_leave_of_the_time_budget():
    params = tiny_params()  # evaluate.n_requests as set there; the closing table types 2 x 1000
    gate_s = 100.0 * params.evaluate.n_requests / 1000
    rows = [replace(_row(1000, 0.3, 0.1), traffic_s=50.0, evaluate_s=gate_s) for _ in range(4)]
    # traffic 20 requests/s; gates 20 typed requests/s -> closing 100 s; 840 - 500 - 100 - 30 - timeout left
    left = 840 - 500 - 100 - 30 - params.ingest.feedback_timeout_s
    assert budget_per_arm(rows, 500.0, 840.0, params) == int(left * 20 / 2)
    assert budget_per_arm(rows, 830.0, 840.0, params) == 300  # nothing left: the smallest test
    assert budget_per_arm([], 0.0, 840.0, params) == 300  # no cycle timed


def test_what_the_budget_leaves_extends_the_ab_test_at_its_first_rounds_pace_up_to_the_cap():
    # a first round decided 100 + 90 requests in 10 s (19/s); 100 s left -> 1900 more: (190 + 1900) / 2 per arm
    fill = AbFill(until=time.perf_counter() + 100.0, max_per_arm=4000)
    assert fill.target({CHAMPION: 100, CHALLENGER: 90}, 10.0, planned=500) == pytest.approx(1045, abs=2)
    assert replace(fill, max_per_arm=800).target({CHAMPION: 100, CHALLENGER: 90}, 10.0, planned=500) == 800
    # past the deadline: never below the planned size, whatever the pace
    late = AbFill(until=time.perf_counter() - 5.0, max_per_arm=4000)
    assert late.target({CHAMPION: 100, CHALLENGER: 90}, 10.0, planned=500) == 500


def test_a_plan_that_fits_predicts_the_test_extended_to_the_budget_or_the_cap():
    params = tiny_params()
    rows = [_timed()]  # traffic at 10 decided requests/s
    pace = measured_pace(rows, params)
    budget = predicted_s(pace, 300.0, 1, 4, 2000, params) + 60.0  # a minute to spare: 600 requests, 300 per arm
    plan = plan_demo(rows, 300.0, 4, budget, 2000, params, max_per_arm=4000)
    assert plan.fits and plan.per_arm == 2000 and plan.filled == 2300
    assert plan.predicted_s == pytest.approx(budget, abs=0.2)
    capped = plan_demo(rows, 300.0, 4, budget, 2000, params, max_per_arm=2100)
    assert capped.filled == 2100 and capped.predicted_s == pytest.approx(budget - 40.0, abs=0.2)
    assert plan_demo(rows, 300.0, 4, budget, 2000, params).filled == 0  # not asked to extend
    over = plan_demo(rows, 300.0, 4, budget - 120.0, 2000, params, max_per_arm=4000)
    assert not over.fits and over.filled == 0  # nothing to spare: the planned test, and the usual choice


def _row(requests: int, suggest_rate: float, accept_rate: float) -> CycleRow:
    nan = float("nan")
    evals = [None] * 5  # eval_judge_mean ... champion_eval_reward_per_request
    return CycleRow(1, "champion:1", requests, suggest_rate, accept_rate, nan, nan, nan, "-", "deployed", *evals, {})


def test_the_reward_sd_comes_from_cycle_one_counts():
    params = tiny_params()
    r = params.reward
    # 100 requests: 50 shown (10 accepted, 40 rejected), 50 abstained
    rewards = [r.accepted] * 10 + [r.rejected] * 40 + [r.abstained] * 50
    mean = sum(rewards) / 100
    sd = (sum((x - mean) ** 2 for x in rewards) / 99) ** 0.5
    assert base_reward_sd(_row(100, 0.5, 0.2), params) == pytest.approx(sd)
    assert base_reward_sd(_row(100, 0.0, 0.0), params) == pytest.approx(0.0, abs=1e-12)  # all abstained


def test_the_story_says_in_words_where_an_interval_includes_zero():
    story = {
        name: {"change": change}
        for name, change in {
            "suggest_rate": [0.1, 0.05, 0.15],
            "accept_rate": [0.01, -0.02, 0.04],
            "right_rate": [-0.05, -0.08, -0.01],
            "chars_saved": [0.0, 0.0, 0.0],
            "reward_per_request": [0.02, 0.001, 0.04],
        }.items()
    }
    lines = story_in_words(story)
    assert "up +0.1000" in lines[0] and "excludes 0" in lines[0]
    assert "includes 0" in lines[1] and "no change can be claimed" in lines[1]
    assert "down -0.0500" in lines[2]
    assert "includes 0" in lines[3]
    assert "excludes 0" in lines[4]
    assert "no candidate was promoted" in story_in_words(story, same_model=True)[0]


def test_the_final_ab_test_puts_the_base_back_and_decides_at_one_look(
    tmp_path, mlflow_store, tiny_model_dir, babbler_dir, typing_regions, prefect_harness
):
    """Base as champion, the final model as challenger, live traffic through a real gateway, one decision. The
    babbler always shows a wrong suggestion: a lower reward than the base's."""
    params = tiny_params(
        tmp_path,
        model={"base_dir": str(tiny_model_dir)},
        serving={"auth": False},
        ingest={"feedback_timeout_s": 1.0},
    )
    runs = CycleRuns(params)
    registry = Registry(params)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    write_regions(typing_regions, regions_path(params.paths.data_dir, "train"), params.traffic)
    base = registry.ensure_champion(tiny_model_dir)
    run_id = runs.start()
    final = registry.register(babbler_dir, run_id)
    runs.end(run_id)
    registry.set_alias(CHAMPION, final.version)  # what the gated cycles leave: the final model is champion

    assert start_ab_test(str(params_file), [], base.label) == final.label
    assert registry.aliased(CHAMPION).version == base.version
    assert registry.aliased(CHALLENGER).version == final.version
    with open_store(params.paths.database_url) as engine:
        arms = {a.name: a.model_version for a in read_arms(engine)}
    assert arms == {CHAMPION: base.label, CHALLENGER: final.label}

    plan = AbPlan(per_arm=40, needed=40, reward_sd=0.2, mde=0.1, power=0.8, alpha=0.05, power_at_n=0.8)
    with pytest.raises(ValueError, match="none is left for the A/B test"):  # never the regions the cycles typed
        run_ab_test(str(params_file), [], tmp_path, plan, users=8, seed=0, typed_regions=len(typing_regions))
    # what the budget leaves extends it past the plan, up to the cap (a far deadline: the cap decides)
    fill = AbFill(until=time.perf_counter() + 3600.0, max_per_arm=60)
    ab = run_ab_test(str(params_file), [], tmp_path, plan, users=8, seed=0, typed_regions=8, fill=fill)
    assert ab["ran_to"] == 60 and ab["plan"]["per_arm"] == 40
    assert min(ab["requests"].values()) >= 60  # sticky users leave one arm short: topped up to the target
    # one look at what each arm has: decided there (never "continue"), and a babbler is never promoted
    assert ab["action"] == "rollback", ab
    assert ab["reason"].startswith(("inconclusive", "challenger worse")), ab["reason"]
    with open_store(params.paths.database_url) as engine:
        assert [a.model_version for a in read_arms(engine)] == [base.label]  # the rollback was applied
    assert registry.aliased(CHALLENGER) is None


def _timed(status: str = "deployed") -> CycleRow:
    # 1000 decided requests in 100 s of traffic (10/s), the cycle flow 150 s of which training 60 and the gate 100
    row = replace(_row(1000, 0.3, 0.1), traffic_s=100.0, train_s=60.0, evaluate_s=100.0, cycle_s=150.0)
    return replace(row, cycle_status=status)


def test_the_plan_after_cycle_one_predicts_the_wall_time_from_the_measured_pace():
    params = tiny_params()
    pace = measured_pace([_timed()], params)
    timeout = params.ingest.feedback_timeout_s
    assert pace.traffic_rps == 10.0 and pace.cycle_s == 100.0 + timeout + 0.5 + 150.0
    assert pace.gate_rps == 2 * params.evaluate.n_requests / 100.0
    # 3 cycles left, an A/B test of 2000 per arm (400 s at 10/s, its fixed costs), the closing table
    ab_s = 400.0 + 30.0 + timeout
    closing_s = 2 * 1000 / pace.gate_rps
    assert predicted_s(pace, 300.0, 1, 4, 2000, params) == pytest.approx(300.0 + 3 * pace.cycle_s + ab_s + closing_s)


def test_a_plan_over_budget_offers_the_most_cycles_that_fit_or_none():
    params = tiny_params()
    rows = [_timed()]
    pace = measured_pace(rows, params)
    budget = predicted_s(pace, 300.0, 1, 2, 2000, params) + 1.0  # two cycles fit, four do not
    plan = plan_demo(rows, 300.0, 4, budget, 2000, params)
    assert not plan.fits and plan.fewer_cycles == 2 and plan.predicted_s > budget
    assert plan_demo(rows, 300.0, 4, 10**6, 2000, params).fits
    # one cycle fits only a budget that leaves no second, and counts only when it promoted a candidate
    one = predicted_s(pace, 300.0, 1, 1, 2000, params) + 1.0
    assert plan_demo(rows, 300.0, 4, one, 2000, params).fewer_cycles == 1
    assert plan_demo([_timed("gate_failed")], 300.0, 4, one, 2000, params).fewer_cycles is None


def test_planned_cycles_with_no_candidate_run_one_more_only_where_it_and_a_smallest_test_fit():
    params = tiny_params()
    rows = [_timed("gate_failed"), _timed("gate_failed")]  # 10 decided requests/s; a cycle's wall time below
    cycle_s = measured_pace(rows, params).cycle_s
    # what is left for A/B traffic after one more cycle: 60 s -> 300 per arm at 10/s, the smallest test
    budget = 600.0 + cycle_s + 60.0 - ab_traffic_left_s(rows, 600.0, 600.0, params)
    assert ab_traffic_left_s(rows, 600.0 + cycle_s, budget, params) == pytest.approx(60.0)
    assert another_cycle_fits(rows, 600.0, budget + 0.5, params)
    assert not another_cycle_fits(rows, 600.0, budget - 1.0, params)
    # the demo asks only when no gate passed: a deployed candidate has its A/B test coming
    args = defaults()  # the shipped params.yaml: its gate and timeout set the closing table's and test's times
    shipped = load_params(args.params)
    cycle_s = measured_pace(rows, shipped).cycle_s
    budget = 600.0 + cycle_s + 60.0 - ab_traffic_left_s(rows, 600.0, 600.0, shipped)
    args.budget_min = (budget + 0.5) / 60
    assert _one_more_cycle(rows, 600.0, args, []) == 1
    assert _one_more_cycle([rows[0], _timed("deployed")], 600.0, args, []) == 0
    args.budget_min = (budget - 1.0) / 60
    assert _one_more_cycle(rows, 600.0, args, []) == 0


def test_a_short_budget_takes_fewer_cycles_or_a_longer_run_but_caps_only_when_asked(capsys):
    params = tiny_params()
    rows = [_timed()]
    budget = predicted_s(measured_pace(rows, params), 300.0, 1, 2, 2000, params) + 1.0
    plan = plan_demo(rows, 300.0, 4, budget, 2000, params)
    assert choose(plan, "ask", 4, budget / 60) == (2, budget / 60)  # not a terminal: fewer cycles, where some fit
    assert choose(plan, "longer", 4, budget / 60) == (4, float(math.ceil(plan.predicted_s / 60)))
    assert choose(plan, "cap", 4, budget / 60) == (4, budget / 60)
    nothing_fits = plan_demo([_timed("gate_failed")], 300.0, 4, 1.0, 2000, params)
    assert choose(nothing_fits, "fewer-cycles", 4, 0.1)[0] == 4  # no fewer cycles fit: the longer run
    assert "Running longer" in capsys.readouterr().out


def test_a_probe_cycle_scales_its_traffic_training_and_the_gates_typing_but_not_what_is_fixed():
    # a probe of 200 requests (150 decided in 20 s), training 6 s, a gate of 200 per model in 30 s of which 20 typing
    row = replace(_timed(), requests=150, traffic_s=20.0, train_s=6.0, evaluate_s=30.0, typing_s=20.0, cycle_s=50.0)
    probe = Probe(row, requests=200, gate_requests=200, startup_s=10.0)
    full = scaled(probe, 1000, 400)
    assert (full.requests, full.traffic_s, full.train_s) == (750, 100.0, 30.0)
    assert full.typing_s == 40.0 and full.evaluate_s == 10.0 + 40.0  # the engines, judge and logging: as measured
    assert full.cycle_s == 50.0 + (30.0 - 6.0) + (50.0 - 30.0)  # ingest, registry, rollout: as measured


def test_the_prediction_is_the_plan_the_demo_makes_after_cycle_one_and_what_it_runs_unattended():
    params = tiny_params()
    row = replace(_timed(), requests=200, traffic_s=20.0, train_s=12.0, evaluate_s=20.0, typing_s=10.0, cycle_s=30.0)
    probe = Probe(row, requests=200, gate_requests=params.evaluate.n_requests, startup_s=12.0)
    full = scaled(probe, 1000, params.evaluate.n_requests)
    elapsed = 12.0 + cycle_wall_s(full, params)
    per_arm = plan_ab(base_reward_sd(full, params), 0.014, params.deploy.alpha, 0.8, 10**9).per_arm
    roomy, runs = predict_demo(probe, params, 4, 1000, 10**6, 0.014, 0.8)
    assert roomy == runs and roomy.fits and roomy.per_arm == per_arm
    assert roomy.predicted_s == pytest.approx(predicted_s(roomy.pace, elapsed, 1, 4, per_arm, params))
    two = predicted_s(roomy.pace, elapsed, 1, 2, per_arm, params)
    asked, runs = predict_demo(probe, params, 4, 1000, two + 1.0, 0.014, 0.8)
    assert not asked.fits and (runs.cycles, runs.predicted_s) == (2, pytest.approx(two)) and runs.fits
    # one cycle is never the prediction: whether cycle 1 passes its gate is not known ahead; nothing fits: longer
    one = predicted_s(roomy.pace, elapsed, 1, 1, per_arm, params)
    asked, runs = predict_demo(probe, params, 4, 1000, one + 1.0, 0.014, 0.8)
    assert asked.fewer_cycles is None and runs.cycles == 4 and runs.budget_s == 60 * math.ceil(asked.predicted_s / 60)
    assert unattended(runs) == (4, runs.budget_s) and runs.fits


def test_a_probe_cycle_times_its_parts_on_a_gate_of_its_own_size_in_a_state_it_removes(
    tmp_path, tiny_model_dir, fim_samples, typing_regions, mlflow_store, prefect_harness, monkeypatch
):
    """`tabrl doctor --predict`'s measurement: one real online cycle (gateway, simulated editors, the cycle flow)
    whose gate types as many requests as its traffic sent, timed, in a temporary state dir."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))  # the loop sets its own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    sections = {
        "model": {"base_dir": str(tiny_model_dir)},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": FAST_TRAIN,
        "evaluate": {"n_samples": 16, "n_requests": 64, "max_new_tokens": 4},
    }
    params, params_file = write_cycle_inputs(tmp_path, tmp_path, fim_samples, typing_regions, **sections)
    write_regions(typing_regions, regions_path(params.paths.data_dir, "train"), params.traffic)
    probe = probe_cycle(str(params_file), [], requests=24, users=4)
    row = probe.row
    assert (probe.requests, probe.gate_requests) == (24, 24) and 0 < row.requests <= 24
    assert row.cycle_status in ("deployed", "gate_failed"), row.cycle_status  # it trained and was gated
    assert row.serving_eval["eval/typing/requests"] == 24  # the gate typed the probe's size, not evaluate.n_requests
    assert 0 < row.typing_s < row.evaluate_s < row.cycle_s and row.train_s > 0 and row.traffic_s > 0
    assert probe.startup_s > 0
    assert list((tmp_path / "tmp").iterdir()) == []  # its state dir is gone


def test_replay_takes_the_wall_clock_out_of_the_demo():
    """--replay: the waiting editor and replayable traffic (simulator.replay, after any --set), no wall-time budget
    and no fill, so what runs depends on the seed alone; without it the demo's own settings and --set's."""
    args = _parser().parse_args(["--replay", "--set", "simulator.client=continue"])
    settings = _overrides(args)
    assert settings[-2:] == ["simulator.client=waits", "simulator.replay=true"]
    assert (args.budget_min, args.ab_fill) == (0.0, False)
    plain = _parser().parse_args(["--set", "train.lr=1e-5"])
    assert _overrides(plain)[-1] == "train.lr=1e-5" and (plain.budget_min, plain.ab_fill) == (14.5, True)
    params = load_params(defaults().params, settings)
    assert params.simulator.replay and params.simulator.client == "waits"
    with pytest.raises(ValueError, match="simulator.replay needs simulator.client=waits"):
        load_params(defaults().params, ["simulator.replay=true"])  # a cancelling editor follows the wall clock
