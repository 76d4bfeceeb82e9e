"""Engines of the training job: the policy's token log-probs, and the optimiser step on one process,
DDP over gloo/NCCL (torch) or DeepSpeed ZeRO. Used by ``tasks/train/ppo.py``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tasks.core.config import TrainParams
from tasks.core.dtypes import resolve_dtype

T = TypeVar("T")


class CompletionPolicy(torch.nn.Module):
    """The causal LM with its head run only on completion positions (no (L, V) logits for prompts)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, gather_idx: torch.Tensor) -> torch.Tensor:
        # attention_mask=None + restarting position_ids: transformers builds the block-diagonal
        # (packed) causal mask for sdpa/eager and uses varlen kernels for flash-attention.
        hidden = self.lm.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (R, W, H)
        return self.lm.lm_head(hidden.flatten(0, 1)[gather_idx])  # (N, V)


def row_log_softmax(logits: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """(N, V) log-probs at each row's sampling temperature, in fp32: computed once per micro-batch, then read
    by `target_logp`, `top_logp`, `top_k_kl` and `first_token_logp`."""
    return F.log_softmax(logits.float() * inv_temp[:, None], dim=-1)


def target_logp(logz: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) log pi(target) and (N,) entropy from `row_log_softmax`."""
    logp = logz.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    with torch.no_grad():
        entropy = -(logz.exp() * logz).sum(-1)  # (N,)
    return logp, entropy


def token_logp(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target) and entropy at the sampling temperature, in fp32."""
    return target_logp(row_log_softmax(logits, inv_temp), targets)


def top_logp(logz: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, k) the k largest log-probs at each position (of `row_log_softmax`) and (N, k) their token ids."""
    with torch.no_grad():
        return logz.topk(min(k, logz.shape[-1]), dim=-1)


def top_k_kl(logz: torch.Tensor, prox_top: torch.Tensor, prox_ids: torch.Tensor) -> torch.Tensor:
    """(N,) KL(pi_prox || pi_theta) at each position over pi_prox's top-k tokens (`top_logp` of the starting
    weights; logz: `row_log_softmax` of the current ones), the rest of the vocabulary lumped into one outcome.

    By the log-sum inequality the lumped tail can only lower the sum, so this is a lower bound of the exact
    KL that is exact when the top k hold all of pi_prox's mass (at T = 0.3 they hold nearly all). Unlike the
    sampled k3 estimate (r - 1) - log r, it does not grow with the ratio of one sampled token: a token
    sampled at p = 0.003 that rose to 0.64 reads 210 in k3 but costs the distribution about one nat."""
    with torch.no_grad():
        theta = logz.gather(-1, prox_ids)  # (N, k) log pi_theta on pi_prox's top k
        p = prox_top.exp()
        kl = (p * (prox_top - theta)).sum(-1)  # (N,)
        tail_p = (1.0 - p.sum(-1)).clamp(min=0.0)  # pi_prox's mass outside its top k
        tail_theta = (1.0 - theta.exp().sum(-1)).clamp(min=1e-12)
        tail = tail_p * (torch.log(tail_p.clamp(min=1e-12)) - torch.log(tail_theta))
        return kl + torch.where(tail_p > 0, tail, torch.zeros_like(tail))


def first_token_logp(logz: torch.Tensor, first_idx: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(E,) log pi(any of token_ids) at each row's first completion position (first_idx into logz's rows,
    `row_log_softmax`): with the stop tokens, the probability of showing nothing."""
    return torch.logsumexp(logz[first_idx][:, token_ids], dim=-1)


def trainable(policy: CompletionPolicy, tp: TrainParams) -> list[torch.nn.Parameter]:
    """The parameters the optimiser updates: all, or all but the token embeddings (a head tied to them is
    the same parameter, so it stays too; an untied head trains)."""
    if not tp.train_embeddings:
        policy.lm.get_input_embeddings().weight.requires_grad_(False)
    return [p for p in policy.parameters() if p.requires_grad]


def lr_at(step: int, total: int, tp: TrainParams) -> float:
    if step < tp.warmup_steps:
        return tp.lr * (step + 1) / tp.warmup_steps
    progress = (step - tp.warmup_steps) / max(1, total - tp.warmup_steps)
    if tp.lr_schedule == "cosine":
        return tp.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if tp.lr_schedule == "linear":
        return tp.lr * (1.0 - progress)
    return tp.lr


class TrainEngine(Protocol):
    """How an update runs its forwards, backwards and optimiser steps: `TorchEngine` or `DeepSpeedEngine`
    (`choose_engine`). The policy's forward is `module(input_ids, position_ids, gather_idx)`."""

    name: str
    dtype: str  # what forwards compute in: "float32" or "bfloat16"

    @property
    def module(self) -> torch.nn.Module:
        """The policy as the engine wraps it (DDP, a DeepSpeed engine, or itself)."""
        ...

    def __init__(self, policy: CompletionPolicy, tp: TrainParams, world: int, device: torch.device) -> None: ...

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """Context of a forward."""
        ...

    def micro_step(self, boundary: bool) -> contextlib.AbstractContextManager[object]:
        """Context of one forward and backward; gradients are synchronised at the step boundary only."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, lr: float) -> float:
        """One optimiser step at lr (gradients clipped to train.grad_clip); the gradient norm."""
        ...

    def fp32_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The weights to save, fp32 on the CPU: all, or those named (an adapter's)."""
        ...


class TorchEngine:
    """One process, or DDP over gloo/NCCL: fp32 weights, torch AdamW; the forward in train.compute_dtype."""

    name = "torch"

    def __init__(self, policy: CompletionPolicy, tp: TrainParams, world: int, device: torch.device):
        self.policy = policy.to(device)
        self.params = trainable(self.policy, tp)
        self.module = torch.nn.parallel.DistributedDataParallel(self.policy) if world > 1 else self.policy
        self.opt = torch.optim.AdamW(self.params, lr=tp.lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay)
        self.tp = tp
        self.device_type = device.type
        self.dtype = resolve_dtype(tp.compute_dtype, device.type)

    def autocast(self):
        """Context of a forward: bf16 autocast when the engine computes in bfloat16 (weights stay fp32)."""
        if self.dtype == "bfloat16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def micro_step(self, boundary: bool):
        """Context of one forward+backward; gradients are synchronised only at the step boundary."""
        if boundary or not isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.tp.grad_clip))
        if math.isfinite(norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def fp32_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The weights to save, fp32 on the CPU: all, or those named (an adapter's)."""
        return {
            n: p.detach().float().cpu() for n, p in self.policy.lm.named_parameters() if names is None or n in names
        }


class DeepSpeedEngine:
    """DeepSpeed ZeRO (train.zero_stage); bf16 compute with fp32 master weights on GPUs; a torch optimiser
    (not a config one, which would JIT-build fused_adam). bf16=True asks for bf16 on DeepSpeed's CPU accelerator
    too (bench/gpu/ppo_bench.py's dry run: the GPU's numerics, slowly)."""

    name = "deepspeed"

    def __init__(
        self, policy: CompletionPolicy, tp: TrainParams, world: int, device: torch.device, bf16: bool | None = None
    ):
        import deepspeed

        self.policy = policy
        opt = torch.optim.AdamW(trainable(policy, tp), lr=tp.lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay)
        config = {
            "train_micro_batch_size_per_gpu": tp.micro_batch,
            # boundaries are set by hand: a step's micro-batch count varies with packing
            "gradient_accumulation_steps": 1,
            "gradient_clipping": tp.grad_clip,
            "zero_optimization": {"stage": tp.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": device.type == "cuda" if bf16 is None else bf16},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.module, self.opt, _, _ = deepspeed.initialize(model=policy, optimizer=opt, config=config)
        self.dtype = "bfloat16" if config["bf16"]["enabled"] else "float32"

    def autocast(self):
        """DeepSpeed casts the weights itself (its bf16 config): a forward needs no autocast."""
        return contextlib.nullcontext()

    def micro_step(self, boundary: bool):
        self.module.set_gradient_accumulation_boundary(boundary)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss)

    def step(self, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.module.step()
        norm = self.module.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def fp32_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The fp32 master weights to save: all, or those named (an adapter's, the only ones the optimiser holds)."""
        from deepspeed.utils import safe_get_full_fp32_param

        # collective under ZeRO-3: every rank calls it for every parameter it asks for
        return {
            n: safe_get_full_fp32_param(p).detach().float().cpu()
            for n, p in self.policy.lm.named_parameters()
            if names is None or n in names
        }


def choose_engine(tp: TrainParams, device: torch.device) -> type[TrainEngine]:
    if tp.engine == "deepspeed" or (tp.engine == "auto" and device.type == "cuda"):
        return DeepSpeedEngine
    return TorchEngine


def all_reduce(values: list[float], device: torch.device, world: int) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_lists(local: dict[int, T], world: int) -> dict[int, T]:
    """Every rank's {example index: value} merged, on every rank."""
    if world == 1:
        return local
    gathered: list[dict[int, T] | None] = [None] * world
    dist.all_gather_object(gathered, local)
    merged: dict[int, T] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
