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
   update, train.compute_dtype included) gives log pi_prox of every completion token at the row's
   temperature; the truncated importance weight min(pi_prox / pi_behaviour, train.is_cap) uses the
   logged behaviour log-probs where present (weight 1 where absent). See `tasks/train/loss.py`.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
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
    StepPlan,
    build_examples,
    dummy_batch,
    pack,
    plan_epoch,
    read_snapshot,
)
from tasks.train.engines import (
    CompletionPolicy,
    DeepSpeedEngine,
    TrainEngine,
    all_gather_lists,
    all_reduce,
    choose_engine,
    has_flash_attn,
    lr_at,
    row_log_softmax,
    target_logp,
    top_logp,
)
from tasks.train.policy import Start, StartError, load_start, save_start, trainable_names
from tasks.train.step import MicroBatch, ProxTop, StepSums, TrainingDiverged, Update, guard, micro_loss, step_metrics


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
    compute_dtype: str = "float32"  # what the forward computed in: float32 | bfloat16 (the weights are fp32 either way)


# ---------------------------------------------------------------- the job


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
            with engine.autocast():
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


@dataclass
class _Job:
    """What every step of one update reads, set up once (`_setup`)."""

    tp: TrainParams
    world: int
    rank: int
    device: torch.device
    start: Start
    rows: list
    examples: list[Example]
    engine: TrainEngine
    make_batch: Callable[[list[int]], Packed]
    stop_ids: torch.Tensor
    prox: dict[int, list[float]]
    prox_top: ProxTop


def _setup(snapshot: Path, from_dir: Path, params: Params, base_dir: str | Path | None) -> _Job:
    """Ranks and device, the starting weights, the examples, the engine and pi_prox (steps 1 and 2)."""
    tp = params.train
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
    examples = build_examples(
        rows,
        tokenizer,
        template,
        prompt_limit(lm, params.serving.max_tokens),
        lm.config.max_position_embeddings,
        abstain_reward=params.reward.abstained if tp.abstain_weight > 0 else None,
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
    return _Job(tp, world, rank, device, start, rows, examples, engine, make_batch, stop_ids, prox, prox_top)


def _step_sums(job: _Job, plan: StepPlan) -> tuple[StepSums, float, int]:
    """Forward and backward over one step's micro-batches: the step's sums over all ranks, the largest ratio
    and the real tokens this rank saw (step 3)."""
    sums = StepSums()
    update = Update(job.examples, job.prox, job.prox_top, job.stop_ids, job.tp, job.world)
    ratio_max = 0.0
    tokens = 0
    for k, idx in enumerate(plan.micro):
        boundary = k == len(plan.micro) - 1
        batch = job.make_batch(idx).to(job.device)
        with job.engine.micro_step(boundary):
            with job.engine.autocast():
                logits = job.engine.module(batch.input_ids, batch.position_ids, batch.gather_idx)  # (N, V)
            logz = row_log_softmax(logits, batch.inv_temp)  # (N, V), read by every term below
            logp, entropy = target_logp(logz, batch.targets)  # (N,)
            if idx:
                loss, stats = micro_loss(MicroBatch(logz, logp, entropy, batch, plan, update))
            else:
                loss, stats = logp.sum() * 0.0, {"tokens": 0.0}
            job.engine.backward(loss)
        sums.add(float(loss.detach()), stats, job.world)
        if stats["tokens"]:
            ratio_max = max(ratio_max, stats["ratio_max"])
        tokens += batch.n_tokens
    return sums.reduced(job.device, job.world), ratio_max, tokens


def _result(
    job: _Job, params: Params, snapshot: Path, from_dir: Path, out: Path, steps: int, seconds: float, tps: float
) -> TrainResult:
    examples = job.examples
    return TrainResult(
        out_dir=str(out),
        algorithm=job.tp.algorithm,
        engine=job.engine.name,
        weights=job.start.name,
        compute_dtype=job.engine.dtype,
        world_size=job.world,
        rows=len(job.rows),
        rows_used=len(examples),
        completion_tokens=sum(e.n_completion for e in examples),
        steps=steps,
        seconds=seconds,
        tokens_per_s=round(tps, 1),
        inputs_sha256=inputs_digest(snapshot, from_dir, params),
        base_dir=str(job.start.base_dir or ""),
    )


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
    job = _setup(snapshot, from_dir, params, base_dir)
    world, rank, engine, examples = job.world, job.rank, job.engine, job.examples
    plans = [plan_epoch(examples, tp, epoch, rank, world) for epoch in range(tp.epochs)]
    total_steps = sum(len(p) for p in plans)
    client = _mlflow_client(mlflow_run_id) if rank == 0 else None
    plural = "s" if world > 1 else ""
    bar = tqdm(total=total_steps, desc=f"train ({engine.name}, {world} rank{plural})", unit="step", disable=rank != 0)
    tokens_seen, step, final, stopped_early = 0, 0, {}, ""
    loop_started = time.time()
    for plan in (plan for epoch_plan in plans for plan in epoch_plan):
        g, ratio_max, tokens = _step_sums(job, plan)
        tokens_seen += tokens
        kl, stopped_early = guard(g, tp, step, total_steps)
        if stopped_early:
            break
        lr = lr_at(step, total_steps, tp)
        grad_norm = engine.step(lr)
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(f"non-finite gradient norm at step {step}; no checkpoint written")
        final = step_metrics(g, kl, grad_norm, lr, ratio_max, tp.abstain_weight > 0)
        if client is not None:
            client(final, step)
        bar.update(1)
        bar.set_postfix(loss=f"{g.loss:.4f}", kl=f"{kl:.2e}")
        step += 1
    bar.close()
    if stopped_early and rank == 0:
        print(f"early stop: {stopped_early}", flush=True)
    seconds = time.time() - started
    tokens_all = all_reduce([float(tokens_seen)], job.device, world)[0]
    loop_seconds = max(time.time() - loop_started, 1e-9)
    state = engine.fp32_state_dict(trainable_names(job.start))
    result = _result(job, params, snapshot, from_dir, out, step, round(seconds, 2), tokens_all / loop_seconds)
    result.final, result.stopped_early = final, stopped_early
    if rank == 0:
        save_start(job.start, state, out, asdict(result))
    if world > 1:
        dist.barrier()
    return result


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
