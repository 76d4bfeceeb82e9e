"""The reference judge on hand-written cases, and the gate on constructed metric pairs."""

from __future__ import annotations

import pytest

from tasks.core.config import EvaluateParams
from tasks.evaluate.gate import gate
from tasks.evaluate.judge import reference_judge
from tasks.evaluate.reference import checks, edit_similarity, parses, reference_score

PREFIX = "def area(width, height):\n    "
SUFFIX = "\n\n\nprint(area(2, 3))\n"
MIDDLE = "return width * height"


def case(middle=MIDDLE, prefix=PREFIX, suffix=SUFFIX, path="geometry.py") -> dict:
    return {"sample_id": "x", "path": path, "span_kind": "line", "prefix": prefix, "suffix": suffix, "middle": middle}


@pytest.mark.parametrize(
    "completion, score",
    [
        ("return width * height", 10),  # exact
        ("return width * height\n", 10),  # trailing whitespace is invisible in the editor
        ("return  width *  height", 8),  # same code up to whitespace, still parses
        ("return width * heigth", 8),  # a typo: near match (sim >= 0.8) that parses
        ("return width *", 6),  # a right start covering over half the middle (does not parse alone: allowed)
        ("return width + height", 8),  # one operator off: near match that parses
        ("return height", 6),  # related, parses, sim >= 0.5
        ("return", 3),  # a right start, but too short to count; some similarity
        ("width * height)", 3),  # similar but breaks the parse
        ("import os", 0),  # unrelated
    ],
)
def test_reference_scores_by_hand(completion, score):
    assert reference_score(checks(case(), completion)) == score


def test_checks_fields():
    c = checks(case(), "return width *")
    assert (c.exact, c.same_code, c.prefix, c.parse_ok) == (False, False, True, False)
    assert 0.5 < c.edit_sim < 1
    assert checks(case(), MIDDLE).parse_ok is True
    # Other languages, and windows whose original does not parse, are not parse-checked.
    assert checks(case(path="area.js"), MIDDLE).parse_ok is None
    assert checks(case(prefix="    if x:\n        "), MIDDLE).parse_ok is None


def test_same_code_that_breaks_indentation_is_penalised():
    sample = case(middle="if width:\n        return 1", prefix="def f(width):\n    ", suffix="\n")
    assert parses(sample["prefix"] + sample["middle"] + sample["suffix"])
    c = checks(sample, "if width:\nreturn 1")  # same tokens, lost indentation
    assert c.same_code and c.parse_ok is False
    assert reference_score(c) == 3


def test_abstentions_are_not_judged_and_helpers_are_sane():
    run = reference_judge([(case(), ""), (case(), " \n"), (case(), MIDDLE)])
    assert run.verdicts[:2] == [None, None] and run.verdicts[2].score == 10
    assert edit_similarity("", "") == 1.0 and edit_similarity("abc", "") == 0.0
    assert not parses("def (:") and not parses("x = '\0'\x00") and parses("x = '\\d'")


def metrics(reward: float, judge: float, scored: float = 100.0, chars: float = 0.10) -> dict[str, float]:
    return {
        "eval/typing/reward_per_request": reward,
        "eval/judge_mean": judge,
        "eval/judge_scored": scored,
        "eval/typing/chars_saved": chars,
    }


GATE = EvaluateParams(gate_tolerance=0.02, gate_margin=0.005, chars_saved_tolerance=0.2)  # 20 %, not the shipped 5 %


@pytest.mark.parametrize(
    "cand, champ, passed, why",
    [
        (metrics(0.10, 5.0), metrics(0.10, 5.0), False, "equal is not better"),
        (metrics(0.12, 5.0), metrics(0.10, 5.0), True, "reward_per_request improves"),
        (metrics(0.10, 5.2), metrics(0.10, 5.0), True, "judge_mean improves"),
        (metrics(0.103, 5.0), metrics(0.10, 5.0), False, "equal is not better"),  # below the margin
        (metrics(0.15, 4.7), metrics(0.10, 5.0), False, "judge_mean drops"),  # judge drop 0.3 > tolerance 0.2
        (metrics(0.15, 4.85), metrics(0.10, 5.0), True, "reward_per_request improves"),  # judge drop within 0.2
        (metrics(0.07, 6.0), metrics(0.10, 5.0), False, "reward_per_request drops"),
        (metrics(0.09, 6.0), metrics(0.10, 5.0), True, "judge_mean improves"),  # reward drop within tolerance
        (metrics(0.20, 6.0, scored=0), metrics(0.10, 5.0), False, "no judge evidence"),
        (metrics(0.20, 6.0), metrics(0.10, 0.0, scored=0), True, "judge mean not compared"),  # champion showed nothing
        (metrics(0.10, 6.0), metrics(0.10, 0.0, scored=0), False, "equal is not better"),  # then reward must improve
    ],
)
def test_gate_decisions(cand, champ, passed, why):
    decision = gate(cand, champ, GATE)
    assert decision.passed is passed
    assert any(why in reason for reason in decision.reasons), decision.reasons
    assert decision.reasons[-1].startswith("PASS" if passed else "FAIL")
    assert decision.numbers["delta/reward_per_request"] == pytest.approx(
        cand["eval/typing/reward_per_request"] - champ["eval/typing/reward_per_request"]
    )
    assert decision.numbers["tolerance/judge_mean"] == pytest.approx(0.2)


def test_equal_is_not_better_even_with_zero_margin():
    zero = EvaluateParams(gate_tolerance=0.0, gate_margin=0.0)
    assert not gate(metrics(0.1, 5.0), metrics(0.1, 5.0), zero).passed
    assert gate(metrics(0.1001, 5.0), metrics(0.1, 5.0), zero).passed


def test_showing_less_to_raise_accept_rate_while_saving_fewer_characters_is_refused():
    """Reward hacking (Copilot's lesson): reward per request and the judge both improve because the
    candidate shows only its surest, shortest suggestions, but users save fewer characters."""
    hacked = metrics(0.15, 6.0, chars=0.05)
    champion = metrics(0.10, 5.0, chars=0.10)
    decision = gate(hacked, champion, GATE)
    assert not decision.passed
    assert any(r.startswith("chars_saved drops") for r in decision.reasons), decision.reasons
    assert decision.numbers["delta/chars_saved"] == pytest.approx(-0.05)
    # Within the tolerance it is not a drop; the same candidate saving as much passes.
    assert gate(metrics(0.15, 6.0, chars=0.097), champion, GATE).passed


def test_the_tolerance_is_relative_to_what_the_code_lets_the_champion_save():
    """On code unlike the traffic the base saves a tenth as much; showing less there can give up most of it
    while moving far less in absolute terms than on familiar code. The same relative drop is refused at both."""
    familiar, foreign = metrics(0.10, 5.0, chars=0.022), metrics(-0.07, 5.0, chars=0.0033)
    assert not gate(metrics(0.12, 5.0, chars=0.0075), familiar, GATE).passed
    hacked = gate(metrics(-0.02, 5.0, chars=0.0012), foreign, GATE)  # reward +0.05 by showing less
    assert not hacked.passed and hacked.numbers["floor/chars_saved"] == pytest.approx(0.0033 * 0.8)
    assert any("chars_saved drops -0.0021" in r for r in hacked.reasons), hacked.reasons
    assert gate(metrics(-0.02, 5.0, chars=0.0030), foreign, GATE).passed  # 9 % below: within 20 %
    never = EvaluateParams(gate_tolerance=0.02, gate_margin=0.005, chars_saved_tolerance=1.0)
    assert gate(metrics(-0.02, 5.0, chars=0.0), foreign, never).passed  # 1: characters saved not checked


def test_drops_within_the_tolerance_cannot_add_up_over_cycles():
    """Each candidate a little below its champion, but together far below what the lineage once saved:
    the gate compares with the lineage's best (the champion's chars_mark) too."""
    params = EvaluateParams(gate_tolerance=0.02, gate_margin=0.005, chars_saved_tolerance=0.05)
    champion = metrics(0.10, 5.0, chars=0.096)  # itself 4 % below the 0.100 its lineage reached
    slipping = metrics(0.15, 6.0, chars=0.093)  # 3 % below the champion, 7 % below the best
    assert gate(slipping, champion, params).passed  # champion alone: within the tolerance
    decision = gate(slipping, champion, params, chars_mark=0.100)
    assert not decision.passed
    assert any("the lineage's best 0.1000; champion 0.0960" in r for r in decision.reasons), decision.reasons
    assert decision.numbers["mark/chars_saved"] == pytest.approx(0.100)
    kept = gate(metrics(0.15, 6.0, chars=0.097), champion, params, chars_mark=0.100)
    assert kept.passed and kept.numbers["mark_after/chars_saved"] == pytest.approx(0.100)  # the mark carries on
    assert kept.mark_held_by == "lineage"  # with the ancestor that set it
    better = gate(metrics(0.15, 6.0, chars=0.104), champion, params, chars_mark=0.100)
    assert better.passed and better.numbers["mark_after/chars_saved"] == pytest.approx(0.104)  # and rises
    assert better.mark_held_by == "candidate"
    below_champion = gate(metrics(0.15, 6.0, chars=0.095), champion, params, chars_mark=0.09)
    assert below_champion.numbers["mark/chars_saved"] == pytest.approx(0.096)  # never below the champion's own
    assert below_champion.passed and below_champion.mark_held_by == "champion"  # which it now holds
    holders = [d.mark_holder_after("champion v2", "ancestor v1") for d in (kept, better, below_champion)]
    assert holders == ["ancestor v1", None, "champion v2"]  # what a promoted candidate's registry tag names
