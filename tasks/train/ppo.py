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
   and ranks give the update of one big batch. With train.abstain_weight > 0 each row adds the
   known-reward abstain term at its first completion position (`tasks/train/loss.py`).
4. guards (all ranks agree; approx-KL is the KL to the starting weights over their top train.kl_top_k
   tokens per position, kept from step 2): a non-finite loss or grad norm, or approx-KL above
   train.max_approx_kl, stops the job with `TrainingDiverged` and no checkpoint; approx-KL above
   the smaller train.target_kl ends the update early (PPO's early stop) and keeps the checkpoint.
5. rank 0 writes the fp32 weights + tokenizer + train_result.json to a temp dir, then renames it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from tasks.core.adapters import AdapterBaseError, file_sha256
from tasks.core.config import Params, TrainParams, load_params
from tasks.core.generate import prompt_limit, split_stops, stops_of
from tasks.train.batching import (
    Example,
    Packed,
    SnapshotError,
    build_examples,
    dummy_batch,
    pack,
    plan_epoch,
    read_snapshot,
)
from tasks.train.engines import (
    CompletionPolicy,
    DeepSpeedEngine,
    all_gather_lists,
    all_reduce,
    choose_engine,
    first_token_logp,
    has_flash_attn,
    lr_at,
    row_log_softmax,
    target_logp,
    top_k_kl,
    top_logp,
)
from tasks.train.loss import abstain_loss, ppo_loss, truncated_is_weight
from tasks.train.policy import StartError, load_start, save_start, trainable_names

METRICS = (
    "train/loss",
    "train/clipfrac",
    "train/approx_kl",
    "train/kl_k3",
    "train/entropy",
    "train/grad_norm",
    "train/lr",
    "train/is_weight",
    "train/ratio_max",
    "train/tokens",
    "train/abstain_p",  # only with train.abstain_weight > 0
)
"""Per-step metric names logged to MLflow (one list, namespaced)."""


class TrainingDiverged(RuntimeError):
    """A guard fired (non-finite loss, approx-KL over the limit); no checkpoint was written."""


@dataclass
class TrainResult:
    out_dir: str
    algorithm: str
    engine: str  # "torch" (single process / DDP) | "deepspeed"
    weights: str  # "full" (a checkpoint) | "lora" (an adapter on base_dir)
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
    base_dir: str = ""  # the base checkpoint of an adapter ("" for a full checkpoint)


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


# ---------------------------------------------------------------- the job


ProxTop = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Per example: (n, k) pi_prox's top-k log-probs at each completion position and (n, k) their token ids."""


@torch.no_grad()
def prox_logps(
    engine, examples: Sequence[Example], make_batch, tp: TrainParams, rank: int, world: int, device
) -> tuple[dict[int, list[float]], ProxTop]:
    """log pi_prox of every completion token with the starting weights, through the training engine, and
    (train.kl_top_k > 0) the top-k log-probs of each position, which the KL guards compare against."""
    engine.module.eval()
    plan = plan_epoch(examples, tp.model_copy(update={"grad_accum": 1 << 20}), epoch=-1, rank=rank, world=world)
    local: dict[int, list[float]] = {}
    tops: ProxTop = {}
    for step in plan:
        for idx in step.micro:
            batch = make_batch(idx).to(device)
            logits = engine.module(batch.input_ids, batch.position_ids, batch.gather_idx)
            logz = row_log_softmax(logits, batch.inv_temp)  # (N, V)
            logp, _ = target_logp(logz, batch.targets)
            if tp.kl_top_k:
                top, ids = top_logp(logz, tp.kl_top_k)
            cursor = 0
            for i in batch.example_idx:
                n = examples[i].n_completion
                local[i] = logp[cursor : cursor + n].tolist()
                if tp.kl_top_k:
                    # clone: on CPU a slice is a view, and pickling it (ranks > 1) would carry the whole batch's storage
                    tops[i] = (top[cursor : cursor + n].cpu().clone(), ids[cursor : cursor + n].to(torch.int32).cpu())
                cursor += n
    engine.module.train()
    return all_gather_lists(local, world), all_gather_lists(tops, world)


def inputs_digest(snapshot: Path, from_dir: Path, params: Params) -> str:
    """What a finished job's result depends on: the snapshot, the starting weights (an adapter's files name its
    base's identity), the train params and the settings the examples are built with."""
    h = hashlib.sha256()
    h.update(snapshot.read_bytes())
    for file in sorted(p for p in from_dir.iterdir() if p.is_file()):
        h.update(file.name.encode())
        h.update(file_sha256(file).encode())
    h.update(json.dumps(params.train.model_dump(mode="json"), sort_keys=True).encode())
    h.update(str(params.serving.max_tokens).encode())
    if params.train.abstain_weight > 0:  # the abstain term's advantage reads the reward of showing nothing
        h.update(str(params.reward.abstained).encode())
    if params.reward.typed_demo is not None:  # the examples of what users typed, and their reward
        h.update(f"typed_demo={params.reward.typed_demo}".encode())
    return h.hexdigest()


def train(
    snapshot: str | Path,
    from_dir: str | Path,
    out_dir: str | Path,
    params: Params,
    mlflow_run_id: str | None = None,
    base_dir: str | Path | None = None,
) -> TrainResult:
    """Run the job on this process (rank/world from the environment when launched by torchrun/deepspeed).
    base_dir: where the base of an adapter from_dir is (default: the path the adapter records)."""
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

    attn = "flash_attention_2" if device.type == "cuda" and has_flash_attn() else "sdpa"
    start = load_start(from_dir, base_dir, tp, attn)
    lm, tokenizer, template = start.lm, start.tokenizer, start.template
    rows = read_snapshot(snapshot)
    abstaining = tp.abstain_weight > 0
    examples = build_examples(
        rows,
        tokenizer,
        template,
        prompt_limit(lm, params.serving.max_tokens),
        lm.config.max_position_embeddings,
        abstain_reward=params.reward.abstained if abstaining else None,
        typed_demo=params.reward.typed_demo,
        abstain_where_typed=tp.abstain_where_typed,
    )
    stop_ids = torch.tensor(split_stops(tokenizer, stops_of(template, tokenizer))[0], device=device)
    if not examples:
        raise SnapshotError(f"snapshot {snapshot}: none of its {len(rows)} rows has completion tokens to train on")
    engine = engine_cls(CompletionPolicy(lm), tp, world, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def make_batch(idx: list[int]) -> Packed:
        return pack(examples, idx, one_row=attn == "flash_attention_2", pad_id=pad_id) if idx else dummy_batch(examples)

    prox, prox_top = prox_logps(engine, examples, make_batch, tp, rank, world, device)
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
            sums = StepSums()
            ratio_max = 0.0
            for k, idx in enumerate(plan.micro):
                boundary = k == len(plan.micro) - 1
                batch = make_batch(idx).to(device)
                with engine.micro_step(boundary):
                    logits = engine.module(batch.input_ids, batch.position_ids, batch.gather_idx)  # (N, V)
                    logz = row_log_softmax(logits, batch.inv_temp)  # (N, V), read by every term below
                    logp, entropy = target_logp(logz, batch.targets)  # (N,)
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
                        if tp.kl_top_k:
                            top = torch.cat([prox_top[i][0] for i in batch.example_idx]).to(device)
                            ids = torch.cat([prox_top[i][1] for i in batch.example_idx]).to(device).long()
                            stats["kl_top_k"] = float(top_k_kl(logz, top, ids).mean())
                        if abstaining:
                            a_logp = first_token_logp(logz, batch.first_idx, stop_ids)  # (E,)
                            a_adv = torch.tensor(
                                [examples[i].abstain_advantage for i in batch.example_idx], device=device
                            )
                            a_loss, a_stats = abstain_loss(
                                a_logp, a_adv, weight=tp.abstain_weight, num_tokens=plan.step_tokens / world
                            )
                            loss, stats = loss + a_loss, {**stats, **a_stats}
                    else:
                        loss, stats = logp.sum() * 0.0, {"tokens": 0.0}
                    engine.backward(loss)
                sums.add(float(loss.detach()), stats, world)
                if stats["tokens"]:
                    ratio_max = max(ratio_max, stats["ratio_max"])
                tokens_seen += batch.n_tokens
            g = sums.reduced(device, world)
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
                stopped_early = (
                    f"{kl_name} {kl:.4g} at step {step} of {total_steps} exceeds train.target_kl="
                    f"{tp.target_kl}; the update stopped there"
                )
                break
            lr = lr_at(step, total_steps, tp)
            grad_norm = engine.step(lr)
            if not math.isfinite(grad_norm):
                raise TrainingDiverged(f"non-finite gradient norm at step {step}; no checkpoint written")
            final = {
                "train/loss": g.loss,
                "train/clipfrac": g.mean("clipfrac"),
                "train/approx_kl": kl,
                "train/kl_k3": g.mean("approx_kl"),
                "train/entropy": g.mean("entropy"),
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                "train/is_weight": g.mean("is_weight"),
                "train/ratio_max": ratio_max,
                "train/tokens": g.tokens,
            }
            if abstaining:  # how often the policy would show nothing on these rows, before this step
                final["train/abstain_p"] = g.abstain_p / max(g.abstain_rows, 1.0)
            if client is not None:
                client(final, step)
            bar.update(1)
            bar.set_postfix(loss=f"{g.loss:.4f}", kl=f"{kl:.2e}")
            step += 1
    bar.close()
    if stopped_early and rank == 0:
        print(f"early stop: {stopped_early}", flush=True)
    seconds = time.time() - started
    tokens_all = all_reduce([float(tokens_seen)], device, world)[0]
    loop_seconds = max(time.time() - loop_started, 1e-9)
    state = engine.fp32_state_dict(trainable_names(start))
    result = TrainResult(
        out_dir=str(out),
        algorithm=tp.algorithm,
        engine=engine.name,
        weights=start.name,
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
        base_dir=str(start.base_dir or ""),
    )
    if rank == 0:
        save_start(start, state, out, asdict(result))
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
    parser.add_argument("--base", default=None, help="the base checkpoint of an adapter --from (default: its record)")
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
        train(args.snapshot, args.from_dir, args.out, params, args.mlflow_run_id, args.base)
    except (TrainingDiverged, SnapshotError, StartError, AdapterBaseError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
