"""One optimiser step of the training job (`tasks/train/ppo.py`): the loss of a micro-batch, the step's statistics
summed over micro-batches and ranks, the guards that stop or end the update, and the metrics logged per step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import torch

from tasks.core import vocab
from tasks.core.config import TrainParams
from tasks.train.batching import Example, Packed, StepPlan
from tasks.train.engines import all_reduce, first_token_logp, top_k_kl
from tasks.train.loss import abstain_loss, ppo_loss, truncated_is_weight

"""Per-step metric names logged to MLflow (one list, namespaced)."""


class TrainingDiverged(RuntimeError):
    """A guard fired (non-finite loss, approx-KL over the limit); no checkpoint was written."""


@dataclass
class StepSums:
    """One optimiser step's statistics, summed over a rank's micro-batches (means weighted by tokens),
    then over ranks (``reduced``)."""

    loss: float = 0.0  # the step's loss (each micro-batch's share, divided by the world size)
    approx_kl: float = 0.0  # sampled k3 approx-KL x tokens
    kl_top_k: float = 0.0  # top-k KL to the starting weights x tokens (train.kl_top_k > 0)
    clipfrac: float = 0.0  # clip fraction x tokens
    entropy: float = 0.0  # entropy x tokens
    is_weight: float = 0.0  # truncated IS weight x tokens
    tokens: float = 0.0  # completion tokens
    non_finite: float = 0.0  # micro-batches whose loss was not finite
    abstain_p: float = 0.0  # pi(abstain) summed over rows (train.abstain_weight > 0)
    abstain_rows: float = 0.0

    def add(self, loss: float, stats: dict[str, float], world: int) -> None:
        self.loss += loss / world
        self.non_finite += 0.0 if math.isfinite(loss) else 1.0
        n = stats["tokens"]
        if n:
            self.approx_kl += stats["approx_kl"] * n
            self.kl_top_k += stats.get("kl_top_k", 0.0) * n
            self.clipfrac += stats["clipfrac"] * n
            self.entropy += stats["entropy"] * n
            self.is_weight += stats["is_weight_mean"] * n
            self.tokens += n
        self.abstain_p += stats.get("abstain_p", 0.0)
        self.abstain_rows += stats.get("abstain_rows", 0.0)

    def reduced(self, device: torch.device, world: int) -> StepSums:
        """The sums over all ranks."""
        return StepSums(*all_reduce(list(astuple(self)), device, world))

    def mean(self, name: str) -> float:
        """A token-weighted mean (approx_kl, clipfrac, entropy, is_weight)."""
        return float(getattr(self, name)) / max(self.tokens, 1.0)


ProxTop = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Per example: (n, k) pi_prox's top-k log-probs at each completion position and (n, k) their token ids."""


@dataclass(frozen=True)
class Update:
    """What every micro-batch of one update reads, fixed for the whole update: its rows, pi_prox's log-probs (and
    top-k), the stop tokens, the train params and the world size."""

    examples: Sequence[Example]
    prox: dict[int, list[float]]
    prox_top: ProxTop
    stop_ids: torch.Tensor
    tp: TrainParams
    world: int


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the loss reads it: the policy's scores on its rows, the rows, the step and the update."""

    logz: torch.Tensor  # (N, V) log-softmax at each completion position
    logp: torch.Tensor  # (N,) the targets' log-probs
    entropy: torch.Tensor  # (N,)
    batch: Packed
    plan: StepPlan
    update: Update


def micro_loss(m: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch that holds rows (PPO, plus the top-k KL statistic and the abstain term when on)."""
    logz, logp, batch, plan, u = m.logz, m.logp, m.batch, m.plan, m.update
    examples, tp, world = u.examples, u.tp, u.world
    device = logp.device
    old, weight, adv = token_inputs(examples, batch.example_idx, u.prox, tp.is_cap, device)
    # DDP/DeepSpeed average gradients over ranks, so each rank divides by step_tokens / world
    loss, stats = ppo_loss(
        logp,
        old,
        adv,
        torch.ones_like(logp),
        clip_low=tp.clip_low,
        clip_high=tp.clip_high,
        is_weight=weight,
        entropy=m.entropy,
        ref_logp=old,
        kl_beta=tp.kl_beta,  # reference = the starting weights
        num_tokens=plan.step_tokens / world,
    )
    if tp.kl_top_k:
        top = torch.cat([u.prox_top[i][0] for i in batch.example_idx]).to(device)
        ids = torch.cat([u.prox_top[i][1] for i in batch.example_idx]).to(device).long()
        stats["kl_top_k"] = float(top_k_kl(logz, top, ids).mean())
    if tp.abstain_weight > 0:
        a_logp = first_token_logp(logz, batch.first_idx, u.stop_ids)  # (E,)
        a_adv = torch.tensor([examples[i].abstain_advantage for i in batch.example_idx], device=device)
        a_loss, a_stats = abstain_loss(a_logp, a_adv, weight=tp.abstain_weight, num_tokens=plan.step_tokens / world)
        loss, stats = loss + a_loss, {**stats, **a_stats}
    return loss, stats


def guard(g: StepSums, tp: TrainParams, step: int, total_steps: int) -> tuple[float, str]:
    """The step's KL statistic, and why the update stops early here ("" when it goes on); raises
    `TrainingDiverged` on a non-finite loss or a KL over train.max_approx_kl."""
    # the guards' statistic: the top-k KL to the starting weights, or (train.kl_top_k = 0) sampled k3
    kl = g.mean("kl_top_k") if tp.kl_top_k else g.mean("approx_kl")
    kl_name = f"approx-KL (top-{tp.kl_top_k} KL to the starting weights)" if tp.kl_top_k else "approx-KL (k3)"
    if g.non_finite > 0 or not math.isfinite(g.loss):
        raise TrainingDiverged(f"non-finite loss at step {step} (loss {g.loss}); no checkpoint written")
    if kl > tp.max_approx_kl:
        raise TrainingDiverged(
            f"{kl_name} {kl:.4g} at step {step} exceeds train.max_approx_kl="
            f"{tp.max_approx_kl}; lower train.lr or raise the limit; no checkpoint written"
        )
    if kl > tp.target_kl:  # PPO's early stop: this step would leave the trust region; keep the weights so far
        return kl, (
            f"{kl_name} {kl:.4g} at step {step} of {total_steps} exceeds train.target_kl="
            f"{tp.target_kl}; the update stopped there"
        )
    return kl, ""


def step_metrics(
    g: StepSums, kl: float, grad_norm: float, lr: float, ratio_max: float, abstaining: bool
) -> dict[str, float]:
    """The metrics of one step (`vocab.STEP_METRICS`)."""
    final = {
        vocab.LOSS: g.loss,
        vocab.CLIPFRAC: g.mean("clipfrac"),
        vocab.APPROX_KL: kl,
        vocab.KL_K3: g.mean("approx_kl"),
        vocab.ENTROPY: g.mean("entropy"),
        vocab.GRAD_NORM: grad_norm,
        vocab.LR: lr,
        vocab.IS_WEIGHT: g.mean("is_weight"),
        vocab.RATIO_MAX: ratio_max,
        vocab.TOKENS: g.tokens,
    }
    if abstaining:  # how often the policy would show nothing on these rows, before this step
        final[vocab.ABSTAIN_P] = g.abstain_p / max(g.abstain_rows, 1.0)
    return final


def token_inputs(examples, idx, prox, is_cap, device):
    """Per completion token: log pi_prox, the truncated IS weight (1 where no behaviour log-probs), the advantage."""
    old, behaviour, adv = [], [], []
    for i in idx:
        ex = examples[i]
        old.extend(prox[i])
        behaviour.extend(ex.behaviour_logp if ex.behaviour_logp is not None else [math.nan] * ex.n_completion)
        adv.extend([ex.advantage] * ex.n_completion)
    old_t = torch.tensor(old, dtype=torch.float32, device=device)  # (N,)
    beh_t = torch.tensor(behaviour, dtype=torch.float32, device=device)  # (N,)
    weight = torch.where(torch.isnan(beh_t), torch.ones_like(old_t), truncated_is_weight(old_t, beh_t, is_cap))
    return old_t, weight, torch.tensor(adv, dtype=torch.float32, device=device)
