import numpy as np
import pytest

from tasks.config import RewardParams
from tasks.intervals import difference, interval, metric_fns

FNS = metric_fns(RewardParams())


def sessions(n: int, accept_p: float, seed: int) -> list[list[int]]:
    """n sessions of 10 requests, all shown, each accepted with accept_p; 100 typed chars, 5 saved per accept."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        acc = int(rng.binomial(10, accept_p))
        rows.append([10, 10, acc, acc, 5 * acc, 100])
    return rows


def test_interval_covers_the_truth_and_shrinks_with_data():
    small = interval([sessions(20, 0.3, 0)], FNS["accept_rate"], n_boot=500)
    large = interval([sessions(500, 0.3, 1)], FNS["accept_rate"], n_boot=500)
    assert small.low < 0.3 < small.high and large.low < 0.3 < large.high
    assert large.high - large.low < (small.high - small.low) / 3
    assert interval([sessions(50, 0.3, 2)], FNS["chars_saved"], n_boot=200).value == pytest.approx(
        sum(r[4] for r in sessions(50, 0.3, 2)) / (50 * 100)
    )


def test_difference_excludes_zero_only_for_a_real_gap():
    a, b = [sessions(300, 0.4, 3), sessions(300, 0.4, 4)], [sessions(300, 0.2, 5), sessions(300, 0.2, 6)]
    gap = difference(a, b, FNS["accept_rate"], n_boot=500)
    assert gap.excludes_zero and gap.low > 0 and gap.value == pytest.approx(0.2, abs=0.03)
    rel = difference(a, b, FNS["accept_rate"], n_boot=500, relative=True)
    assert rel.value == pytest.approx(1.0, abs=0.2) and rel.excludes_zero
    same = difference([sessions(300, 0.3, 7)], [sessions(300, 0.3, 8)], FNS["accept_rate"], n_boot=500)
    assert not same.excludes_zero


def test_reward_per_request_uses_the_reward_params():
    rows = [[4, 2, 1, 1, 3, 10]]  # 1 accepted, 1 rejected, 2 abstained
    value = interval([rows], FNS["reward_per_request"], n_boot=10).value
    assert value == pytest.approx((0.75 - 0.25 + 0) / 4)
    with pytest.raises(ValueError, match="at least one typing session"):
        interval([[]], FNS["accept_rate"])
