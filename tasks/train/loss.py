"""The policy loss of tabrl: a token-level clipped surrogate, critic-free. One pure function.

How it departs from textbook PPO (Schulman et al. 2017), and why:

* **No critic, one-step return.** A completion is one action sequence that ends the episode;
  its return is the user's verdict (accepted / rejected / abstained), known only at the end. The
  advantage is that return (optionally minus a batch baseline, chosen by the reward stage) and is
  given to every completion token alike. A value network would double the memory for a signal
  that a batch baseline already gives (as in GRPO / REINFORCE++ / RLOO).
* **Token level.** The ratio and clip act per completion token; prompt tokens carry no loss.
  `token_mean` averages over all completion tokens of the optimiser step (pass `num_tokens`),
  so long completions are not down-weighted and gradient accumulation / data parallelism give
  the same update as one big batch.
* **Asymmetric clip** (`clip_high` > `clip_low`, DAPO's "clip-higher"): low-probability tokens
  that were right can still gain mass, which keeps exploration alive.
* **Off-policy data, decoupled.** Logged data comes from the *behaviour* policy (the serving
  model, possibly a version behind, with other kernels). The full importance ratio is
  pi_theta / pi_behaviour, factorised as
  ``is_weight = min(pi_prox / pi_behaviour, C)`` (detached, truncated; TIS, Yao et al. 2025) times
  ``ratio = pi_theta / pi_prox`` (clipped), where pi_prox is the starting weights recomputed
  by the trainer (decoupled PPO, Hilton et al. 2022). The trust region is centred on weights the
  trainer can evaluate exactly, and serving/training numeric mismatch cannot blow up a step.
* **A known-reward abstain term (optional, ``abstain_loss``).** Showing nothing earns a fixed reward
  whatever the user would have done, so for every logged row the abstain action's advantage over what
  was shown is known without sampling it: reward.abstained - the row's reward (+0.25 after a reject,
  -0.75 after an accept). The policy abstains by emitting a stop token first, so the term is a policy
  gradient on log pi(stop | prompt) at the completion's first position, which the trainer computes
  anyway. A sampled-only estimator reaches that action at the rate the policy already abstains (about 1 %
  of requests at T = 0.3), and the ratio clip would let it grow by at most 1 + clip_high per update; this
  term is not clipped, so the approx-KL early stop (which sees the shown first tokens lose the mass) is
  its trust region. It also leaves out the pi(stop) factor of the exact gradient pi(stop) x A x grad log
  pi(stop): every row pushes as if the empty suggestion had been sampled there (~1/pi(stop) harder than
  its share of the expected reward), which is what lets an action sampled ~1 % of the time move at all.
* **No KL penalty by default.** The clip is the trust region, and each cycle starts from the
  last checkpoint; the optional k3 KL to a reference (`kl_beta` > 0) is there for long runs.

Shapes: every tensor argument has the same shape, e.g. ``(B, T)`` padded or ``(N,)`` packed
completion tokens; ``mask`` is 1 on completion tokens that carry loss and 0 elsewhere.
"""

from __future__ import annotations

from typing import Literal

import torch


# long: the loss reads top to bottom as the math (STYLE habit 4), and its stats share every intermediate
def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    entropy: torch.Tensor | None = None,
    agg: Literal["token_mean", "token_sum"] = "token_mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate -min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A) over masked tokens.

    logp: log pi_theta of the taken tokens (requires grad); old_logp: log pi_prox (no grad);
    advantages: per token (a completion's advantage repeated over its tokens); is_weight: the
    truncated importance weight per token (None = 1); ref_logp + kl_beta: k3 KL to a reference;
    entropy: per-token policy entropy, reported only. `num_tokens` is the denominator of
    `token_mean` (default: the tokens in `mask`); pass the optimiser step's token count when a
    step is split into micro-batches or ranks. Returns (scalar loss, stats of the masked tokens).
    """
    mask = mask.to(logp.dtype)  # (...,) 1 = completion token with loss
    n_masked = mask.sum().clamp(min=1.0)
    log_ratio = logp - old_logp.detach()  # (...,)
    ratio = torch.exp(log_ratio)  # (...,) pi_theta / pi_prox
    adv = advantages.detach()
    pg_loss1 = -adv * ratio  # (...,)
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (...,)
    per_token = torch.maximum(pg_loss1, pg_loss2)  # (...,) pessimistic bound
    if is_weight is not None:
        per_token = is_weight.detach() * per_token
    if kl_beta > 0.0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs ref_logp (log-probs of the reference model)")
        ref_log_ratio = ref_logp.detach() - logp  # (...,)
        kl_k3 = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0  # (...,) k3 estimator of KL(pi_theta || pi_ref), >= 0
        per_token = per_token + kl_beta * kl_k3
    total = (per_token * mask).sum()
    if agg == "token_mean":
        loss = total / (n_masked if num_tokens is None else num_tokens)
    elif agg == "token_sum":
        loss = total
    else:
        raise ValueError(f"agg must be 'token_mean' or 'token_sum', got {agg!r}")

    with torch.no_grad():
        on = mask > 0
        r = ratio[on] if on.any() else ratio.new_ones(1)
        clipped = (pg_loss2 > pg_loss1).to(logp.dtype)  # the clip bound was the one taken
        stats = {
            "clipfrac": float((clipped * mask).sum() / n_masked),
            # k3 estimator of KL(pi_prox || pi_theta) (Schulman's approx-KL, as in cleanrl)
            "approx_kl": float((((ratio - 1.0) - log_ratio) * mask).sum() / n_masked),
            "ratio_min": float(r.min()),
            "ratio_mean": float(r.mean()),
            "ratio_max": float(r.max()),
            "tokens": float(mask.sum()),
        }
        if entropy is not None:
            stats["entropy"] = float((entropy * mask).sum() / n_masked)
        if is_weight is not None:
            stats["is_weight_mean"] = float((is_weight * mask).sum() / n_masked)
        if kl_beta > 0.0:
            stats["kl_ref"] = float((kl_k3 * mask).sum() / n_masked)
    return loss, stats


def truncated_is_weight(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_prox / pi_behaviour, cap) per token (TIS): corrects serving/training mismatch, never by more than cap."""
    return torch.clamp(torch.exp(prox_logp - behaviour_logp), max=cap)


def abstain_loss(
    abstain_logp: torch.Tensor,
    abstain_advantage: torch.Tensor,
    *,
    weight: float,
    num_tokens: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-weight * sum(A_abstain * log pi(abstain)) / num_tokens over one step's rows (see the module doc).

    abstain_logp: (E,) log pi_theta of a stop token as the first completion token of each row (at the row's
    temperature, requires grad); abstain_advantage: (E,) reward.abstained - the row's reward; num_tokens: the
    step's token-mean denominator, so each row counts like one completion token of `ppo_loss`.
    Returns (scalar loss, {"abstain_p": sum of pi(abstain) over the rows, "abstain_rows": E}).
    """
    adv = abstain_advantage.detach()
    loss = -weight * (adv * abstain_logp).sum() / num_tokens
    with torch.no_grad():
        stats = {"abstain_p": float(abstain_logp.exp().sum()), "abstain_rows": float(abstain_logp.numel())}
    return loss, stats
