"""The PPO loss against numbers worked out by hand, and the truncated importance weight."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.train.engines import row_log_softmax, top_k_kl, top_logp
from tasks.train.loss import ppo_loss, truncated_is_weight

# token:        a (clip high)  b (clip low)  c (inside)  d (inside, pessimistic)  e (masked)
RATIOS = [1.5, 0.5, 1.1, 0.5, 3.0]
ADV = [1.0, -1.0, 2.0, 1.0, 5.0]
MASK = [1.0, 1.0, 1.0, 1.0, 0.0]


def _inputs():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0])
    logp = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return logp, old, torch.tensor(ADV), torch.tensor(MASK)


def test_loss_matches_hand_computed_example_with_both_clips_and_a_masked_token():
    logp, old, adv, mask = _inputs()
    loss, stats = ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # a: -min(1.5*1, 1.28*1) = -1.28 | b: -min(0.5*-1, 0.8*-1) = 0.8 | c: -2.2 | d: -min(0.5, 0.8) = -0.5
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2 - 0.5) / 4, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(0.5)  # a and b
    assert stats["ratio_min"] == pytest.approx(0.5) and stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5) / 4, abs=1e-6)
    kl = sum((r - 1) - math.log(r) for r in RATIOS[:4]) / 4
    assert stats["approx_kl"] == pytest.approx(kl, rel=1e-5)
    loss.backward()
    # clipped tokens and the masked one get no gradient; d(-A*r)/dlogp = -A*r, over 4 tokens
    expected = torch.tensor([0.0, 0.0, -2.0 * 1.1 / 4, -1.0 * 0.5 / 4, 0.0])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_is_weight_kl_and_step_denominator():
    logp, old, adv, mask = _inputs()
    weight = torch.tensor([2.0, 1.0, 0.5, 1.0, 9.0])
    loss, _ = ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, is_weight=weight, num_tokens=8)
    assert loss.item() == pytest.approx((-1.28 * 2 + 0.8 - 2.2 * 0.5 - 0.5) / 8, abs=1e-6)
    ref = old.clone()
    loss_kl, stats = ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_beta=0.1)
    k3 = [1 / r - 1 + math.log(r) for r in RATIOS[:4]]  # exp(ref - logp) - (ref - logp) - 1
    assert stats["kl_ref"] == pytest.approx(sum(k3) / 4, rel=1e-5)
    assert loss_kl.item() == pytest.approx((-1.28 + 0.8 - 2.2 - 0.5) / 4 + 0.1 * sum(k3) / 4, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, kl_beta=0.1)


def test_truncated_is_weight_caps_the_ratio_of_recomputed_to_behaviour():
    prox = torch.tensor([-1.0, -1.0, -1.0, -5.0])
    behaviour = torch.tensor([-1.0, -1.5, -9.0, -1.0])
    w = truncated_is_weight(prox, behaviour, cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(0.5), 2.0, math.exp(-4.0)]), atol=1e-6)


def _exact_kl(prox_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    p, q = torch.log_softmax(prox_logits, -1), torch.log_softmax(logits, -1)
    return (p.exp() * (p - q)).sum(-1)


def test_top_k_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_with_less():
    g = torch.Generator().manual_seed(0)
    prox, new = torch.randn(6, 50, generator=g) * 3, torch.randn(6, 50, generator=g) * 3
    ones = torch.ones(6)
    exact = _exact_kl(prox, new)
    whole = top_k_kl(row_log_softmax(new, ones), *top_logp(row_log_softmax(prox, ones), 50))
    assert torch.allclose(whole, exact, atol=1e-5)
    for k in (1, 5, 20):
        bound = top_k_kl(row_log_softmax(new, ones), *top_logp(row_log_softmax(prox, ones), k))
        assert (bound <= exact + 1e-5).all() and (bound >= -1e-6).all()
    # the temperature scales the logits of both sides, as the rows were sampled
    half = torch.full((6,), 2.0)
    scaled = top_k_kl(row_log_softmax(new, half), *top_logp(row_log_softmax(prox, half), 50))
    assert torch.allclose(scaled, _exact_kl(prox * 2, new * 2), atol=1e-5)


def test_one_rare_token_that_became_likely_costs_top_k_kl_a_nat_and_k3_two_hundred():
    """The replayed divergence of docs/lab ("Why approx-KL jumped"): a token sampled at p = 0.003 rose to 0.64."""
    prox = torch.log(torch.tensor([[0.9, 0.097, 0.003]]))
    new = torch.log(torch.tensor([[0.3, 0.06, 0.64]]))
    r = 0.64 / 0.003
    k3 = (r - 1) - math.log(r)
    one = torch.ones(1)
    top = top_k_kl(row_log_softmax(new, one), *top_logp(row_log_softmax(prox, one), 2))  # the rare token: in the tail
    assert k3 > 200 and 0.5 < float(top) < 1.5
    assert float(top) == pytest.approx(float(_exact_kl(prox, new)), abs=0.01)
