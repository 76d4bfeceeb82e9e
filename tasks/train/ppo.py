"""The training job: critic-free PPO on a reward-labelled snapshot -> an updated HF checkpoint.

    # one CPU process (what `tabrl train` runs in-process when train.nproc = 1)
    python -m tasks.train.ppo --snapshot data/interactions/S.parquet --from models/tabrl-tiny --out models/cand
    # N CPU ranks over gloo (plain torch DDP)
    torchrun --nproc_per_node 2 -m tasks.train.ppo --snapshot ... --from ... --out ...
    # N GPUs: DeepSpeed ZeRO (train.zero_stage), bf16 compute with fp32 master weights, NCCL
    deepspeed --num_gpus 8 --module tasks.train.ppo --snapshot ... --from ... --out ...

`tasks/train/launch.py` picks the line. The order of work:

1. rows -> examples: prompt ids exactly as served (`encode_prompt` with `serving.max_tokens`),
   completion ids as sampled (stop token included); rows with no completion tokens are skipped.
2. pi_prox: one no-grad pass with the starting weights (the same engine and numerics as the
   update) gives log pi_prox of every completion token at the row's temperature; the truncated
   importance weight min(pi_prox / pi_behaviour, train.is_cap) uses the logged behaviour
   log-probs where present (weight 1 where absent). See `tasks/train/loss.py`.
3. epochs x optimiser steps: each step takes micro_batch x grad_accum x world rows, balanced
   over ranks by tokens; each rank packs its rows into micro-batches (one row per micro-batch,
   sequences concatenated, position ids restarting per sequence: no padding); the LM head runs
   only on completion positions; the loss is a token mean over the whole step, so accumulation
   and ranks give the update of one big batch.
4. guards (all ranks agree): a non-finite loss or grad norm, or approx-KL above
   train.max_approx_kl, stops the job with `TrainingDiverged` and no checkpoint; approx-KL above
   the smaller train.target_kl ends the update early (PPO's early stop) and keeps the checkpoint.
5. rank 0 writes the fp32 weights + tokenizer + train_result.json to a temp dir, then renames it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from tasks.config import Params, TrainParams, load_params
from tasks.generate import encode_prompt, prompt_limit
from tasks.train.loss import ppo_loss

METRICS = (
    "train/loss",
    "train/clipfrac",
    "train/approx_kl",
    "train/entropy",
    "train/grad_norm",
    "train/lr",
    "train/is_weight",
    "train/ratio_max",
    "train/tokens",
)
"""Per-step metric names logged to MLflow (one list, namespaced)."""

RESULT_FILE = "train_result.json"
SNAPSHOT_COLUMNS = ("prompt", "token_ids", "logprobs", "temperature", "advantage")


class SnapshotError(ValueError):
    """A snapshot that cannot be trained on; the message names the column or row."""


class TrainingDiverged(RuntimeError):
    """A guard fired (non-finite loss, approx-KL over the limit); no checkpoint was written."""


@dataclass
class Example:
    input_ids: list[int]  # prompt ids + completion ids
    n_prompt: int
    advantage: float
    temperature: float  # the scale of the sampling distribution (1.0 for greedy)
    behaviour_logp: list[float] | None  # logged at serving, one per completion token

    @property
    def n_completion(self) -> int:
        return len(self.input_ids) - self.n_prompt


@dataclass
class TrainResult:
    out_dir: str
    algorithm: str
    engine: str  # "torch" (single process / DDP) | "deepspeed"
    world_size: int
    rows: int  # rows in the snapshot
    rows_used: int  # rows with completion tokens (they carry gradient)
    completion_tokens: int  # per epoch
    steps: int
    seconds: float
    tokens_per_s: float  # real tokens (prompt + completion) per second of the update loop, all ranks
    final: dict[str, float] = field(default_factory=dict)  # last step's train/... metrics
    inputs_sha256: str = ""  # snapshot + starting checkpoint + train params: same inputs, same result
    stopped_early: str = ""  # why the update stopped before its last step (train.target_kl), "" when it ran to the end


# ---------------------------------------------------------------- data


def read_snapshot(path: str | Path) -> list[dict]:
    """Rows of a reward-labelled snapshot (tasks/schema.py REWARDED_SCHEMA)."""
    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"snapshot {path} not found")
    table = pq.read_table(path)
    missing = [c for c in SNAPSHOT_COLUMNS if c not in table.column_names]
    if missing:
        raise SnapshotError(f"snapshot {path} lacks column(s) {missing}; run the reward stage first")
    return table.select(list(SNAPSHOT_COLUMNS)).to_pylist()


def build_examples(rows: Sequence[dict], tokenizer, limit: int, max_len: int) -> list[Example]:
    """Training sequences from snapshot rows; rows with no completion tokens carry no gradient and are left out."""
    examples = []
    for i, row in enumerate(rows):
        completion = row["token_ids"] or []
        if not completion:
            continue
        if row["advantage"] is None or not math.isfinite(row["advantage"]):
            raise SnapshotError(f"row {i}: advantage is {row['advantage']!r}; every row needs a finite advantage")
        behaviour = row["logprobs"]
        if behaviour is not None and len(behaviour) != len(completion):
            raise SnapshotError(f"row {i}: {len(behaviour)} logprobs for {len(completion)} token_ids")
        prompt = encode_prompt(tokenizer, row["prompt"], limit)
        ids = prompt + list(completion)
        if len(ids) > max_len:
            raise SnapshotError(f"row {i}: {len(ids)} tokens exceed the model's {max_len} positions")
        temperature = row["temperature"] if row["temperature"] and row["temperature"] > 0 else 1.0
        examples.append(
            Example(
                ids,
                len(prompt),
                float(row["advantage"]),
                float(temperature),
                None if behaviour is None else [float(x) for x in behaviour],
            )
        )
    return examples


@dataclass
class Packed:
    """Sequences packed into R rows of width W, position ids restarting at each sequence (no attention mask).

    With flash-attention (varlen kernels) everything goes into one row. Otherwise rows are bins as wide
    as the longest sequence, filled first-fit-decreasing: sdpa then builds a block-diagonal mask per
    row, so attention costs sum(T) * W rather than sum(T)^2, and the rest of each row is padding that
    forms its own sequence and is never gathered."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W)
    gather_idx: torch.Tensor  # (N,) flat positions (row * W + col) whose hidden state predicts a completion token
    targets: torch.Tensor  # (N,) the completion tokens
    inv_temp: torch.Tensor  # (N,) 1 / temperature of each token's row
    example_idx: list[int]  # in the order their tokens appear in targets
    n_tokens: int  # real tokens, padding excluded

    def to(self, device) -> Packed:
        for name in ("input_ids", "position_ids", "gather_idx", "targets", "inv_temp"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def pack(examples: Sequence[Example], idx: Sequence[int], one_row: bool = False, pad_id: int = 0) -> Packed:
    lengths = {i: len(examples[i].input_ids) for i in idx}
    width = sum(lengths.values()) if one_row else max(lengths.values())
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(idx, key=lambda j: (-lengths[j], j)):
        k = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if k is None:
            bins.append([])
            room.append(width)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    gather, targets, inv_temp, order = [], [], [], []
    for r, members in enumerate(bins):
        col = 0
        for i in members:
            ex = examples[i]
            n = len(ex.input_ids)
            ids[r, col : col + n] = torch.tensor(ex.input_ids)
            pos[r, col : col + n] = torch.arange(n)
            # the hidden state at position t predicts token t + 1
            gather.extend(range(r * width + col + ex.n_prompt - 1, r * width + col + n - 1))
            targets.extend(ex.input_ids[ex.n_prompt :])
            inv_temp.extend([1.0 / ex.temperature] * ex.n_completion)
            order.append(i)
            col += n
        pos[r, col:] = torch.arange(width - col)  # padding: a sequence of its own
    return Packed(
        input_ids=ids,
        position_ids=pos,
        gather_idx=torch.tensor(gather, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        inv_temp=torch.tensor(inv_temp, dtype=torch.float32),
        example_idx=order,
        n_tokens=sum(lengths.values()),
    )


def split_micro(idx: Sequence[int], examples: Sequence[Example], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Greedy micro-batches of at most max_rows rows and max_tokens tokens (a longer row goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    cur_tokens = 0
    for i in idx:
        n = len(examples[i].input_ids)
        if cur and (len(cur) >= max_rows or cur_tokens + n > max_tokens):
            out.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        out.append(cur)
    return out


def shard(idx: Sequence[int], examples: Sequence[Example], world: int) -> list[list[int]]:
    """Rows to ranks, longest first to the rank with fewest tokens (deterministic on every rank)."""
    ranks: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(idx, key=lambda j: (-len(examples[j].input_ids), j)):
        r = min(range(world), key=lambda k: (load[k], k))
        ranks[r].append(i)
        load[r] += len(examples[i].input_ids)
    return ranks


@dataclass
class StepPlan:
    micro: list[list[int]]  # this rank's micro-batches; [] = a dummy that keeps collectives in step
    step_tokens: int  # completion tokens of the whole step, all ranks


def plan_epoch(examples: Sequence[Example], tp: TrainParams, epoch: int, rank: int, world: int) -> list[StepPlan]:
    """The same shuffle on every rank; each step split over ranks, then into micro-batches."""
    order = list(range(len(examples)))
    random.Random(f"{tp.seed}:{epoch}").shuffle(order)
    per_step = tp.micro_batch * tp.grad_accum * world
    plans = []
    for start in range(0, len(order), per_step):
        rows = order[start : start + per_step]
        per_rank = [
            split_micro(r, examples, tp.micro_batch, tp.max_tokens_per_micro_batch)
            for r in shard(rows, examples, world)
        ]
        n_micro = max(len(m) for m in per_rank)
        mine = per_rank[rank] + [[] for _ in range(n_micro - len(per_rank[rank]))]
        plans.append(StepPlan(mine, sum(examples[i].n_completion for i in rows)))
    return plans


# ---------------------------------------------------------------- model


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


def token_logp(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target) and entropy at the sampling temperature, in fp32."""
    logz = F.log_softmax(logits.float() * inv_temp[:, None], dim=-1)  # (N, V)
    logp = logz.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    with torch.no_grad():
        entropy = -(logz.exp() * logz).sum(-1)  # (N,)
    return logp, entropy


def lr_at(step: int, total: int, tp: TrainParams) -> float:
    if step < tp.warmup_steps:
        return tp.lr * (step + 1) / tp.warmup_steps
    progress = (step - tp.warmup_steps) / max(1, total - tp.warmup_steps)
    if tp.lr_schedule == "cosine":
        return tp.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if tp.lr_schedule == "linear":
        return tp.lr * (1.0 - progress)
    return tp.lr


class TorchEngine:
    """One process, or DDP over gloo/NCCL: fp32 weights, torch AdamW."""

    name = "torch"

    def __init__(self, policy: CompletionPolicy, tp: TrainParams, world: int, device: torch.device):
        self.policy = policy.to(device)
        self.module = torch.nn.parallel.DistributedDataParallel(self.policy) if world > 1 else self.policy
        self.opt = torch.optim.AdamW(
            self.policy.parameters(), lr=tp.lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay
        )
        self.tp = tp

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
        norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.tp.grad_clip))
        if math.isfinite(norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu() for n, p in self.policy.lm.named_parameters()}


class DeepSpeedEngine:
    """DeepSpeed ZeRO (train.zero_stage); bf16 compute with fp32 master weights on GPUs; a torch optimiser
    (not a config one, which would JIT-build fused_adam)."""

    name = "deepspeed"

    def __init__(self, policy: CompletionPolicy, tp: TrainParams, world: int, device: torch.device):
        import deepspeed

        self.policy = policy
        opt = torch.optim.AdamW(policy.parameters(), lr=tp.lr, betas=(0.9, 0.95), weight_decay=tp.weight_decay)
        config = {
            "train_micro_batch_size_per_gpu": tp.micro_batch,
            # boundaries are set by hand: a step's micro-batch count varies with packing
            "gradient_accumulation_steps": 1,
            "gradient_clipping": tp.grad_clip,
            "zero_optimization": {"stage": tp.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": device.type == "cuda"},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.module, self.opt, _, _ = deepspeed.initialize(model=policy, optimizer=opt, config=config)

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

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        # collective under ZeRO-3: every rank calls it for every parameter
        return {n: safe_get_full_fp32_param(p).detach().float().cpu() for n, p in self.policy.lm.named_parameters()}


def choose_engine(tp: TrainParams, device: torch.device) -> type[TorchEngine] | type[DeepSpeedEngine]:
    if tp.engine == "deepspeed" or (tp.engine == "auto" and device.type == "cuda"):
        return DeepSpeedEngine
    return TorchEngine


# ---------------------------------------------------------------- the job


def _all_reduce(values: list[float], device: torch.device, world: int) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _all_gather_lists(local: dict[int, list[float]], world: int) -> dict[int, list[float]]:
    if world == 1:
        return local
    gathered: list[dict[int, list[float]] | None] = [None] * world
    dist.all_gather_object(gathered, local)
    merged: dict[int, list[float]] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def _dummy(examples: Sequence[Example]) -> Packed:
    """Two tokens, one gathered position: a forward/backward with zero loss for a rank with no rows left."""
    ids = examples[0].input_ids[:2]
    return Packed(
        torch.tensor([ids]), torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([ids[1]]), torch.ones(1), [], 0
    )


@torch.no_grad()
def prox_logps(
    engine, examples: Sequence[Example], make_batch, tp: TrainParams, rank: int, world: int, device
) -> dict[int, list[float]]:
    """log pi_prox of every completion token with the starting weights, through the training engine."""
    engine.module.eval()
    plan = plan_epoch(examples, tp.model_copy(update={"grad_accum": 1 << 20}), epoch=-1, rank=rank, world=world)
    local: dict[int, list[float]] = {}
    for step in plan:
        for idx in step.micro:
            batch = make_batch(idx).to(device)
            logits = engine.module(batch.input_ids, batch.position_ids, batch.gather_idx)
            logp, _ = token_logp(logits, batch.targets, batch.inv_temp)
            cursor = 0
            for i in batch.example_idx:
                n = examples[i].n_completion
                local[i] = logp[cursor : cursor + n].tolist()
                cursor += n
    engine.module.train()
    return _all_gather_lists(local, world)


def inputs_digest(snapshot: Path, from_dir: Path, params: Params) -> str:
    h = hashlib.sha256()
    h.update(snapshot.read_bytes())
    for name in sorted(p.name for p in from_dir.iterdir() if p.is_file()):
        h.update(name.encode())
        h.update((from_dir / name).read_bytes())
    h.update(json.dumps(params.train.model_dump(mode="json"), sort_keys=True).encode())
    h.update(str(params.serving.max_tokens).encode())
    return h.hexdigest()


def _tmp_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp")


def train(
    snapshot: str | Path, from_dir: str | Path, out_dir: str | Path, params: Params, mlflow_run_id: str | None = None
) -> TrainResult:
    """Run the job on this process (rank/world from the environment when launched by torchrun/deepspeed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    snapshot, from_dir, out = Path(snapshot), Path(from_dir), Path(out_dir)
    tp = params.train
    started = time.time()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    engine_cls = choose_engine(tp, device)
    if engine_cls is DeepSpeedEngine:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    elif world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(tp.seed)

    tokenizer = AutoTokenizer.from_pretrained(from_dir, local_files_only=True)
    attn = "flash_attention_2" if device.type == "cuda" and _has_flash_attn() else "sdpa"
    lm = AutoModelForCausalLM.from_pretrained(
        from_dir, local_files_only=True, dtype=torch.float32, attn_implementation=attn
    )
    rows = read_snapshot(snapshot)
    examples = build_examples(
        rows, tokenizer, prompt_limit(lm, params.serving.max_tokens), lm.config.max_position_embeddings
    )
    if not examples:
        raise SnapshotError(f"snapshot {snapshot}: none of its {len(rows)} rows has completion tokens to train on")
    engine = engine_cls(CompletionPolicy(lm), tp, world, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def make_batch(idx: list[int]) -> Packed:
        return pack(examples, idx, one_row=attn == "flash_attention_2", pad_id=pad_id) if idx else _dummy(examples)

    prox = prox_logps(engine, examples, make_batch, tp, rank, world, device)
    plans = [plan_epoch(examples, tp, epoch, rank, world) for epoch in range(tp.epochs)]
    total_steps = sum(len(p) for p in plans)
    client = _mlflow_client(mlflow_run_id) if rank == 0 else None
    bar = tqdm(
        total=total_steps,
        desc=f"train ({engine.name}, {world} rank{'s' if world > 1 else ''})",
        unit="step",
        disable=rank != 0,
    )
    tokens_seen, step, final, stopped_early = 0, 0, {}, ""
    loop_started = time.time()
    for epoch_plan in plans:
        if stopped_early:
            break
        for plan in epoch_plan:
            # per-rank sums: loss, approx-KL*tokens, clipfrac*tokens, entropy*tokens, is_weight*tokens, tokens,
            # non-finite
            sums = [0.0] * 7
            ratio_max = 0.0
            for k, idx in enumerate(plan.micro):
                boundary = k == len(plan.micro) - 1
                batch = make_batch(idx).to(device)
                with engine.micro_step(boundary):
                    logits = engine.module(batch.input_ids, batch.position_ids, batch.gather_idx)  # (N, V)
                    logp, entropy = token_logp(logits, batch.targets, batch.inv_temp)  # (N,)
                    if idx:
                        old, weight, adv = _token_inputs(examples, batch.example_idx, prox, tp.is_cap, device)
                        # DDP/DeepSpeed average gradients over ranks, so each rank divides by step_tokens / world
                        loss, stats = ppo_loss(
                            logp,
                            old,
                            adv,
                            torch.ones_like(logp),
                            clip_low=tp.clip_low,
                            clip_high=tp.clip_high,
                            is_weight=weight,
                            entropy=entropy,
                            ref_logp=old,
                            kl_beta=tp.kl_beta,  # reference = the starting weights
                            num_tokens=plan.step_tokens / world,
                        )
                    else:
                        loss, stats = logp.sum() * 0.0, {"tokens": 0.0}
                    engine.backward(loss)
                n = stats["tokens"]
                lv = float(loss.detach())
                sums[0] += lv / world
                sums[6] += 0.0 if math.isfinite(lv) else 1.0
                if n:
                    sums[1] += stats["approx_kl"] * n
                    sums[2] += stats["clipfrac"] * n
                    sums[3] += stats["entropy"] * n
                    sums[4] += stats["is_weight_mean"] * n
                    sums[5] += n
                    ratio_max = max(ratio_max, stats["ratio_max"])
                tokens_seen += batch.n_tokens
            g = _all_reduce(sums, device, world)
            kl = g[1] / max(g[5], 1.0)
            if g[6] > 0 or not math.isfinite(g[0]):
                raise TrainingDiverged(f"non-finite loss at step {step} (loss {g[0]}); no checkpoint written")
            if kl > tp.max_approx_kl:
                raise TrainingDiverged(
                    f"approx-KL {kl:.4g} at step {step} exceeds train.max_approx_kl="
                    f"{tp.max_approx_kl}; lower train.lr or raise the limit; no checkpoint written"
                )
            if kl > tp.target_kl:  # PPO's early stop: this step would leave the trust region; keep the weights so far
                stopped_early = (
                    f"approx-KL {kl:.4g} at step {step} of {total_steps} exceeds train.target_kl="
                    f"{tp.target_kl}; the update stopped there"
                )
                break
            lr = lr_at(step, total_steps, tp)
            grad_norm = engine.step(lr)
            if not math.isfinite(grad_norm):
                raise TrainingDiverged(f"non-finite gradient norm at step {step}; no checkpoint written")
            final = {
                "train/loss": g[0],
                "train/clipfrac": g[2] / max(g[5], 1.0),
                "train/approx_kl": kl,
                "train/entropy": g[3] / max(g[5], 1.0),
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                "train/is_weight": g[4] / max(g[5], 1.0),
                "train/ratio_max": ratio_max,
                "train/tokens": g[5],
            }
            if client is not None:
                client(final, step)
            bar.update(1)
            bar.set_postfix(loss=f"{g[0]:.4f}", kl=f"{kl:.2e}")
            step += 1
    bar.close()
    if stopped_early and rank == 0:
        print(f"early stop: {stopped_early}", flush=True)
    seconds = time.time() - started
    tokens_all = _all_reduce([float(tokens_seen)], device, world)[0]
    loop_seconds = max(time.time() - loop_started, 1e-9)
    state = engine.fp32_state_dict()
    result = TrainResult(
        out_dir=str(out),
        algorithm=tp.algorithm,
        engine=engine.name,
        world_size=world,
        rows=len(rows),
        rows_used=len(examples),
        completion_tokens=sum(e.n_completion for e in examples),
        steps=step,
        seconds=round(seconds, 2),
        tokens_per_s=round(tokens_all / loop_seconds, 1),
        final=final,
        inputs_sha256=inputs_digest(snapshot, from_dir, params),
        stopped_early=stopped_early,
    )
    if rank == 0:
        save_checkpoint(lm, tokenizer, state, out, result)
    if world > 1:
        dist.barrier()
    return result


def _token_inputs(examples, idx, prox, is_cap, device):
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


def truncated_is_weight(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_prox / pi_behaviour, cap) per token (TIS): corrects serving/training mismatch, never by more than cap."""
    return torch.clamp(torch.exp(prox_logp - behaviour_logp), max=cap)


def save_checkpoint(lm, tokenizer, state: dict[str, torch.Tensor], out: Path, result: TrainResult) -> None:
    """fp32 weights + tokenizer + train_result.json into a temp dir, renamed into place (atomic on one filesystem)."""
    tmp = _tmp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    lm.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    # fp32 on disk whatever the compute dtype: lr ~1e-6 updates vanish in bf16 weights
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _mlflow_client(run_id: str | None):
    """A metrics logger for run_id (MlflowClient: logging from a launched rank never ends the parent's run)."""
    if run_id is None:
        return None
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient()

    def log(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    return log


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--from", dest="from_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--params", default="params.yaml", help="params.yaml (env and --set overrides apply)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--resolved-params", default=None, help="a resolved params file from launch_train (used as is)")
    parser.add_argument("--mlflow-run-id", default=None)
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if args.resolved_params:
        params = load_params(args.resolved_params, environ={})
    else:
        params = load_params(args.params, args.overrides)
    try:
        train(args.snapshot, args.from_dir, args.out, params, args.mlflow_run_id)
    except (TrainingDiverged, SnapshotError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
