import numpy as np
import pytest

from tasks.core.config import RewardParams
from tasks.core.intervals import difference, interval, metric_fns, pair_sessions

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


def shared_regions(n: int, lift: float, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(a, b): the same n regions typed by two models. How easy a region is (its accept chance, 0-60 %) and the
    users' noise draws are shared; a also takes `lift` more of the suggestions b's users turn down."""
    rng = np.random.default_rng(seed)
    a, b = [], []
    for p in rng.uniform(0.0, 0.6, size=n):
        draws = rng.random(10)
        acc_b = int((draws < p).sum())
        acc_a = int((draws < p + lift).sum())
        b.append([10, 10, acc_b, acc_b, 5 * acc_b, 100])
        a.append([10, 10, acc_a, acc_a, 5 * acc_a, 100])
    return a, b


def test_a_paired_difference_sees_a_small_lift_an_unpaired_one_misses():
    pairs = [shared_regions(150, 0.03, seed) for seed in (10, 11, 12)]
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    unpaired = difference(a, b, FNS["accept_rate"], n_boot=500)
    paired = difference(a, b, FNS["accept_rate"], n_boot=500, paired=True)
    assert paired.value == pytest.approx(unpaired.value) and paired.value == pytest.approx(0.03, abs=0.01)
    assert paired.excludes_zero and paired.low > 0 and not unpaired.excludes_zero
    assert paired.high - paired.low < (unpaired.high - unpaired.low) / 3
    rel = difference(a, b, FNS["accept_rate"], n_boot=500, relative=True, paired=True)
    assert rel.low > 0
    # no lift: pairing does not invent one
    same = [shared_regions(150, 0.0, seed) for seed in (13, 14, 15)]
    none = difference([x for x, _ in same], [y for _, y in same], FNS["accept_rate"], n_boot=500, paired=True)
    assert none.value == 0.0 and not none.excludes_zero
    # independent noise draws on both sides: paired or not, a no-lift comparison stays within noise
    indep = difference([sessions(300, 0.3, 16)], [sessions(300, 0.3, 17)], FNS["accept_rate"], n_boot=500, paired=True)
    assert not indep.excludes_zero


def test_pairing_lines_up_each_seeds_sessions_and_keeps_every_count():
    a = [[[1, 1, 0, 0, 0, 9]] * 4, [[1, 1, 1, 1, 2, 9]] * 2]
    b = [[[1, 1, 1, 1, 2, 9]] * 3, [[1, 1, 0, 0, 0, 9]] * 2]
    lined_a, lined_b, added = pair_sessions(a, b)
    assert [len(s) for s in lined_a] == [len(s) for s in lined_b] == [4, 2] and added == 1
    assert lined_b[0][3] == [0] * 6  # b's cap stopped a region earlier: an empty partner
    for metric in FNS.values():  # the paired point value is the difference on all the data
        paired = difference(a, b, metric, n_boot=50, paired=True)
        assert paired.value == pytest.approx(difference(a, b, metric, n_boot=50).value)
    with pytest.raises(ValueError, match="same seeds on both sides: 2 vs 1"):
        difference(a, b[:1], FNS["accept_rate"], paired=True)
