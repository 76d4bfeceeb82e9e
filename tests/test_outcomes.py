"""The one counts type (issue 41 item 3): its derived counts, its rates, and its pricing through outcomes.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tasks.core.config import RewardParams
from tasks.core.outcomes import ArmCounts, reward_of, reward_per_request, reward_std, taken_chars


def _samples(counts: ArmCounts, reward: RewardParams) -> np.ndarray:
    """The per-request rewards the counts stand for, one value per request."""
    return np.array(
        [reward_of("accepted", reward)] * counts.accepted
        + [reward_of("rejected", reward)] * counts.rejected
        + [reward_of("abstained", reward)] * counts.abstained
    )


def test_requests_shown_and_rates_derive_from_the_three_outcomes():
    c = ArmCounts(accepted=3, rejected=5, abstained=2, accepted_chars=60)
    assert (c.requests, c.shown) == (10, 8)
    assert c.suggest_rate == 0.8 and c.accept_rate == 3 / 8 and c.chars_per_request == 6.0


def test_empty_counts_have_zero_rates_and_prices():
    c = ArmCounts(accepted=0, rejected=0, abstained=0, accepted_chars=0)
    assert (c.suggest_rate, c.accept_rate, c.chars_per_request) == (0.0, 0.0, 0.0)
    assert reward_per_request(c, RewardParams()) == 0.0 and reward_std(c, RewardParams()) == 0.0


def test_pricing_equals_the_mean_and_sample_std_of_the_rewards():
    reward = RewardParams()
    for c in (
        ArmCounts(accepted=30, rejected=50, abstained=20, accepted_chars=0),
        ArmCounts(accepted=1, rejected=0, abstained=0, accepted_chars=0),
        ArmCounts(accepted=0, rejected=7, abstained=0, accepted_chars=0),
    ):
        raw = _samples(c, reward)
        assert reward_per_request(c, reward) == pytest.approx(raw.mean())
        assert reward_std(c, reward) == (pytest.approx(raw.std(ddof=1)) if raw.size > 1 else 0.0)


def test_pricing_is_the_formula_it_replaced():
    """The simulator's and the A/B test's old formulas, written out: the numbers must not move."""
    reward = RewardParams()
    c = ArmCounts(accepted=45, rejected=40, abstained=15, accepted_chars=0)
    n, shown, acc = 100, 85, 45
    mean = (acc * reward.accepted + (shown - acc) * reward.rejected + (n - shown) * reward.abstained) / n
    squares = acc * reward.accepted**2 + (shown - acc) * reward.rejected**2 + (n - shown) * reward.abstained**2
    assert reward_per_request(c, reward) == mean
    assert reward_std(c, reward) == math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1))


def test_accepted_per_char_stays_out_of_the_pricing():
    """accepted_per_char shapes training only; the live and evaluated numbers price outcomes alone."""
    c = ArmCounts(accepted=2, rejected=1, abstained=1, accepted_chars=50)
    shaped = RewardParams(accepted_per_char=0.01)
    assert reward_per_request(c, shaped) == reward_per_request(c, RewardParams())


def test_counts_are_frozen_and_never_negative():
    c = ArmCounts(accepted=1, rejected=0, abstained=0, accepted_chars=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.accepted = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="rejected=-1"):
        ArmCounts(accepted=1, rejected=-1, abstained=0, accepted_chars=0)


def test_taken_characters_are_the_reported_count_else_the_whole_suggestion():
    assert taken_chars("accepted", "x = 1 + 2", 5) == 5
    assert taken_chars("accepted", "x = 1 + 2", None) == 9
    assert taken_chars("rejected", "x = 1 + 2", None) == 0 and taken_chars("abstained", "", None) == 0
