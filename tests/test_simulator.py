import random

import pytest

from tasks.core.config import Persona, load_params
from tasks.sim.users import SimUser, is_right, make_users, normalise, replay, right_if_cut, summarise

MIDDLE = "self.assertEqual(result, expected)\n        return result"
STRICT = Persona(name="strict", min_accept_chars=4)


@pytest.mark.parametrize(
    "suggestion, expected",
    [
        ("self.assertEqual(result, expected)", True),  # exact prefix
        (MIDDLE, True),  # the whole middle
        ("self.assertEqual(result,   expected)\n  return", True),  # whitespace variants
        ("  self.assert", True),  # leading whitespace, partial identifier
        ("sel", False),  # too short: fewer than K non-blank characters
        ("self.assertTrue(result)", False),  # wrong
        ("self.assertEqual(result, expected) + 1", False),  # runs past what the user meant
        ("", False),
    ],
)
def test_rule_on_hand_written_cases(suggestion, expected):
    assert is_right(suggestion, MIDDLE, STRICT.min_accept_chars) is expected


def test_right_if_cut_finds_the_best_stop():
    assert right_if_cut("self.assertEqual(result, expected) + 1", MIDDLE, 4)  # right until it ran on
    assert right_if_cut("self.assertTrue(result)", MIDDLE, 4)  # "self.assert" is right: 11 non-blanks
    assert not right_if_cut("sel_x", MIDDLE, 4)  # only 3 characters in common
    assert not right_if_cut("return", MIDDLE, 4) and not right_if_cut("", MIDDLE, 4)


def test_short_middle_caps_k():
    assert is_right("x)", "x)", 4)  # the whole (short) middle is enough
    assert normalise("  a \n\t b  ") == "a b"


def test_decisions_with_personas():
    user = SimUser("u1", STRICT)
    rng = random.Random(0)
    assert user.decide("", MIDDLE, rng) == "abstained"
    assert user.decide("   ", MIDDLE, rng) == "abstained"
    assert user.decide("self.assertEqual(", MIDDLE, rng) == "accepted"
    assert user.decide("print()", MIDDLE, rng) == "rejected"
    sloppy = SimUser("u2", Persona(name="sloppy", p_accept_wrong=1.0))
    assert sloppy.decide("print()", MIDDLE, rng) == "accepted"
    lazy = SimUser("u3", Persona(name="lazy", p_ignore_right=1.0))
    assert lazy.decide("self.assertEqual(", MIDDLE, rng) == "rejected"


def test_users_and_replay_are_seeded_and_reproducible():
    params = load_params(None, environ={}).simulator
    users = make_users(50, params)
    assert users == make_users(50, params)
    assert {u.persona.name for u in users} == {"careful", "typical", "hasty"}
    samples = [{"sample_id": str(i), "middle": MIDDLE} for i in range(40)]
    suggestions = ["self.assertEqual(", "nope()", ""] * 13 + ["self.assert"]
    first = replay(samples, suggestions, users, seed=3)
    assert first == replay(samples, suggestions, users, seed=3)
    summary = summarise(first, suggestions)
    assert summary.requests == 40 and summary.shown == 27
    assert 0 < summary.accept_rate < 1 and summary.suggest_rate == pytest.approx(27 / 40)
