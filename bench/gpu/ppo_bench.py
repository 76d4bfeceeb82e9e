"""tabrl's PPO update on one GPU: DeepSpeed ZeRO-2 bf16 (NCCL) against a plain torch loop, full and LoRA.

    bash bench/gpu/run.sh                      # a lent H100/H200: installs missing wheels, ~3 min, $OUT/ppo_bench.json
    bash bench/gpu/run.sh --dry-run            # CPU, tiny shapes, every step below (CI runs it)
    python -m bench.gpu.ppo_bench --out DIR    # the same without run.sh's wheel install

Four runs, each in a process of its own (peak memory is per run, and no DeepSpeed state outlives its run):

    deepspeed/full  tasks.train.engines.DeepSpeedEngine, ZeRO-2, bf16 weights and compute, fp32 master weights
    plain/full      tasks.train.engines.TorchEngine: fp32 weights + torch.autocast bf16, AdamW, no DeepSpeed
    deepspeed/lora  the same two on a PEFT LoRA adapter (tasks.train.policy.lora_config: rank 16, all linear
    plain/lora      layers, the base frozen)

Every optimiser step is the project's update on 16 sequences: `pack` (tasks/train/batching.py), the LM head
on the completion positions only (`CompletionPolicy`), `row_log_softmax` at the serving temperature,
`target_logp`, `ppo_loss` (tasks/train/loss.py) with params.yaml's clip, then the engine's step. It is
on-policy (pi_prox = the current weights, detached), as the first step of every update is; the no-grad
pi_prox pass before an update, the guards' top-k KL and the abstain term are not timed (each is a small
part of a step).

Shapes: Qwen2.5-Coder-1.5B (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936,
tied embeddings, rope theta 1e6), random init; every sequence T = 1024 tokens, its last 128 a completion.
Tokens/s counts every token (prompt and completion) of the timed steps, after the warm-up steps; it is
compared with the anchor (35.0k tokens/s: DeepSpeed ZeRO-2 bf16, these shapes, head on the last 128
positions, micro-batch 16, one H100) and with the plain loop of the same weights.

Memory (what the micro-batches are sized to; activations measured per layer on CPU with saved-tensor hooks:
~0.10 GiB per 1024-token sequence per layer in bf16, ~0.11 GiB under autocast): full fine-tuning keeps
~24 GiB of states (bf16 weights and gradients, fp32 master weights, Adam's two moments; 16 bytes per
parameter) and, at 16 sequences, ~44 GiB of activations plus ~5 GiB for the head's (N, V) log-probs: ~73 GiB
of an H100's ~79, too close. So full runs 8 sequences x 2 accumulated micro-batches (~50 GiB); LoRA, with
~3 GiB of states, runs 16 x 1 (~53 GiB; the plain loop ~66 GiB). No activation checkpointing by default
(`--checkpointing` turns it on, e.g. for `--full-micro-batch 16`); the JSON says what each run used.

Loss check: before deepspeed/full's first step, the PPO loss of one fixed batch (4 sequences) is computed
with the fp32 weights in fp32, then through the bf16 DeepSpeed engine on the same weights, with the same
pi_prox (the fp32 log-probs, shifted by fixed noise so that the ratio, and so the loss, reads the log-probs)
and advantages; the JSON holds both losses, their relative difference and the log-prob differences.

The dry run runs all of it on CPU at tiny shapes: DeepSpeed's CPU accelerator over gloo, bf16 as on the GPU.
Writes OUT/ppo_bench.json (OUT/runs/: each run's own record) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from tasks.core.config import Params, TrainParams, load_params
from tasks.train.batching import Example, Packed, pack
from tasks.train.engines import (
    CompletionPolicy,
    DeepSpeedEngine,
    TorchEngine,
    has_flash_attn,
    row_log_softmax,
    target_logp,
)
from tasks.train.loss import ppo_loss

ROOT = Path(__file__).resolve().parents[2]
# DeepSpeed ZeRO-2 bf16, Qwen2.5-Coder-1.5B shapes, T = 1024, head on the last 128 positions, micro-batch 16, one H100
ANCHOR_TOKENS_PER_S = 35_000.0
WEIGHTS = ("full", "lora")
RUNS = tuple(
    f"{e}/{w}" for w in WEIGHTS for e in ("deepspeed", "plain")
)  # deepspeed/full, plain/full, deepspeed/lora, plain/lora

QWEN25_CODER_1_5B = {
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
}
TINY = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Bench:
    """What one invocation measures: the GPU's shapes and sizes, or the dry run's."""

    shape: dict
    """Qwen2Config keyword arguments of the randomly initialised model."""
    seq_len: int
    """T: tokens of every sequence (prompt + completion)."""
    completion: int
    """Completion tokens of every sequence: the positions the LM head and the loss run on."""
    step_rows: int
    """Sequences per optimiser step (the anchor's micro-batch); micro-batches accumulate up to it."""
    full_micro_batch: int
    """Sequences per forward/backward when every weight trains (memory: see the module docstring)."""
    lora_micro_batch: int
    """Sequences per forward/backward of the LoRA runs."""
    checkpointing: bool
    """Activation checkpointing (transformers' gradient checkpointing, non-reentrant) in every run."""
    warmup_steps: int
    """Optimiser steps before the clock starts (kernel choice, allocator, DeepSpeed's buffers)."""
    timed_steps: int
    """Optimiser steps timed for tokens/s."""
    check_rows: int
    """Sequences of the loss check's fixed batch."""
    run_timeout_s: int
    """Wall-clock limit of one run's process."""

    def micro_batch(self, weights: str) -> int:
        return self.full_micro_batch if weights == "full" else self.lora_micro_batch


# Why the GPU's defaults are what they are (the module docstring has the arithmetic); the JSON carries it.
GPU_SIZING = (
    "full: 8 sequences x 2 accumulated micro-batches, no activation checkpointing (16 x 1 would need ~73 GiB of an "
    "H100's ~79); lora: 16 x 1, no activation checkpointing (~53 GiB, the plain loop ~66 GiB)"
)
GPU = Bench(
    shape=QWEN25_CODER_1_5B,
    seq_len=1024,
    completion=128,
    step_rows=16,
    full_micro_batch=8,
    lora_micro_batch=16,
    checkpointing=False,
    warmup_steps=3,
    timed_steps=8,
    check_rows=4,
    run_timeout_s=240,
)
DRY_RUN = Bench(
    shape=TINY,
    seq_len=64,
    completion=16,
    step_rows=4,
    full_micro_batch=2,
    lora_micro_batch=4,
    checkpointing=False,
    warmup_steps=1,
    timed_steps=2,
    check_rows=2,
    run_timeout_s=600,  # the first DeepSpeed start JIT-builds a CPU comm op: 1-4 min on 2 busy cores
)


def bench_params(bench: Bench, weights: str) -> Params:
    """params.yaml (the clip, lr, grad clip, serving temperature) with this run's batch sizes; full trains every
    weight, the tied embeddings too (16 bytes of states per parameter: the memory the GPU sizes are chosen for)."""
    micro = bench.micro_batch(weights)
    overrides = [
        f"train.micro_batch={micro}",
        f"train.grad_accum={bench.step_rows // micro}",
        "train.zero_stage=2",
        f"train.adapter={'lora' if weights == 'lora' else 'none'}",
        "train.train_embeddings=true",
    ]
    return load_params(ROOT / "params.yaml", overrides, environ={})


def workload(bench: Bench, n: int, temperature: float, seed: int) -> list[Example]:
    """n sequences of random token ids, the last bench.completion of each a completion sampled at temperature."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, bench.shape["vocab_size"], (n, bench.seq_len), generator=g)
    advantages = torch.where(torch.rand(n, generator=g) < 0.3, 0.75, -0.25)  # accepted / rejected rows
    n_prompt = bench.seq_len - bench.completion
    return [Example(ids[i].tolist(), n_prompt, float(advantages[i]), temperature, None) for i in range(n)]


def build_policy(bench: Bench, weights: str, tp: TrainParams, device: torch.device) -> tuple[CompletionPolicy, str]:
    """The random-init model (seed 0: the same weights in every run) on the device, a fresh LoRA adapter on it for
    lora, and its attention implementation."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    attn = "flash_attention_2" if device.type == "cuda" and has_flash_attn() else "sdpa"
    torch.manual_seed(0)
    with device:
        lm = Qwen2ForCausalLM(Qwen2Config(**bench.shape, attn_implementation=attn))
    if bench.checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if weights == "lora":
        from peft import get_peft_model

        from tasks.train.policy import lora_config

        lm = get_peft_model(lm, lora_config(tp)).base_model.model  # LoRA layers injected in place, as load_start does
    lm.train()
    return CompletionPolicy(lm), attn


def token_advantages(examples: list[Example], batch: Packed, device: torch.device) -> torch.Tensor:
    """(N,) each completion token's advantage: its sequence's, in the order of batch.targets."""
    adv = [examples[i].advantage for i in batch.example_idx for _ in range(examples[i].n_completion)]
    return torch.tensor(adv, dtype=torch.float32, device=device)


def completion_logp(module, batch: Packed, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) log pi(target) and (N,) entropy at the completion positions, in fp32; autocast: the forward in bf16."""
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = module(batch.input_ids, batch.position_ids, batch.gather_idx)  # (N, V)
    return target_logp(row_log_softmax(logits, batch.inv_temp), batch.targets)


def optimiser_step(
    engine: DeepSpeedEngine | TorchEngine,
    examples: list[Example],
    micro: list[list[int]],
    tp: TrainParams,
    autocast: bool,
    packed_one_row: bool,
    device: torch.device,
) -> tuple[float, float]:
    """One optimiser step over micro-batches of example indices, as tasks/train/ppo.py runs one.
    Returns (loss, grad norm)."""
    step_tokens = sum(examples[i].n_completion for idx in micro for i in idx)
    total = 0.0
    for k, idx in enumerate(micro):
        batch = pack(examples, idx, one_row=packed_one_row).to(device)
        with engine.micro_step(k == len(micro) - 1):
            logp, entropy = completion_logp(engine.module, batch, autocast)  # (N,)
            loss, _ = ppo_loss(
                logp,
                logp.detach(),  # on-policy: pi_prox is the current weights
                token_advantages(examples, batch, device),
                torch.ones_like(logp),
                clip_low=tp.clip_low,
                clip_high=tp.clip_high,
                entropy=entropy,
                num_tokens=step_tokens,
            )
            engine.backward(loss)
        total += float(loss.detach())
    return total, engine.step(tp.lr)


@torch.no_grad()
def check_logp(module, batch: Packed) -> torch.Tensor:
    """(N,) fp32 log-probs of the loss check's batch through module (fp32 or bf16 weights), no autocast."""
    module.eval()
    logp, _ = completion_logp(module, batch, autocast=False)
    module.train()
    return logp


def loss_check(
    logp_fp32: torch.Tensor, logp_bf16: torch.Tensor, examples: list[Example], batch: Packed, tp: TrainParams
) -> dict[str, float | int | str]:
    """Both PPO losses of the fixed batch with the same pi_prox (the fp32 log-probs shifted by fixed noise, so
    that ratios of ~exp(+-0.2), some clipped, make the loss read the log-probs) and advantages."""
    noise = torch.randn(logp_fp32.shape, generator=torch.Generator().manual_seed(1)).to(logp_fp32.device)
    old = logp_fp32 + 0.2 * noise  # (N,)
    adv = token_advantages(examples, batch, logp_fp32.device)
    ones = torch.ones_like(old)
    loss_fp32, _ = ppo_loss(logp_fp32, old, adv, ones, clip_low=tp.clip_low, clip_high=tp.clip_high)
    loss_bf16, _ = ppo_loss(logp_bf16, old, adv, ones, clip_low=tp.clip_low, clip_high=tp.clip_high)
    diff = (logp_bf16 - logp_fp32).abs()
    return {
        "rows": len(examples),
        "loss_fp32": float(loss_fp32),
        "loss_bf16": float(loss_bf16),
        "rel_diff": float((loss_bf16 - loss_fp32).abs() / loss_fp32.abs().clamp(min=1e-12)),
        "logp_abs_diff_mean": float(diff.mean()),
        "logp_abs_diff_max": float(diff.max()),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(device: torch.device) -> dict[str, float | str]:
    if device.type == "cuda":
        return {
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "peak_mem_kind": "torch.cuda.max_memory_allocated",
        }
    # ru_maxrss is in KiB on Linux; on CPU it is the whole process's, model and Python included
    return {"peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_mem_kind": "max RSS"}


def run_one(name: str, bench: Bench, dry_run: bool) -> dict:
    """One run in this process (a child of `main`): its record."""
    engine_name, weights = name.split("/")
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    params = bench_params(bench, weights)
    tp, temperature = params.train, params.serving.temperature
    micro_batch = bench.micro_batch(weights)
    if engine_name == "deepspeed":
        import deepspeed

        if dry_run:
            where = os.environ.get("TORCH_EXTENSIONS_DIR", "torch's default, ~/.cache/torch_extensions")
            print(
                f"[{name}] DeepSpeed's CPU comm op is JIT-built on its first start, then cached ({where})", flush=True
            )
        deepspeed.init_distributed(dist_backend="gloo" if dry_run else "nccl")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = time.perf_counter()
    policy, attn = build_policy(bench, weights, tp, device)
    record: dict = {
        "run": name,
        "engine": engine_name,
        "weights": weights,
        "device": device_name(device),
        "micro_batch": micro_batch,
        "grad_accum": tp.grad_accum,
        "activation_checkpointing": bench.checkpointing,
        "attention": attn,
        "params": sum(p.numel() for p in policy.parameters()),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
    }
    checking = name == "deepspeed/full"
    if checking:  # the fp32 pass before DeepSpeed casts the weights to bf16 in place
        check = workload(bench, bench.check_rows, temperature, seed=2)
        check_batch = pack(check, range(len(check))).to(device)  # a row per sequence: any attention runs it
        policy.lm.set_attn_implementation("sdpa")  # flash-attention kernels have no fp32
        logp_fp32 = check_logp(policy, check_batch)
        policy.lm.set_attn_implementation(attn)
    if engine_name == "deepspeed":
        engine: DeepSpeedEngine | TorchEngine = DeepSpeedEngine(policy, tp, 1, device, bf16=True)
        autocast = False  # bf16 weights: DeepSpeed's own mixed precision
    else:
        engine = TorchEngine(policy, tp, 1, device)
        autocast = True
    record["setup_s"] = time.perf_counter() - started
    if checking:
        record["loss_check"] = loss_check(logp_fp32, check_logp(engine.module, check_batch), check, check_batch, tp)
    print(
        f"[{name}] {record['params'] / 1e6:.1f}M params, {record['trainable_params'] / 1e6:.1f}M trained, "
        f"micro-batch {micro_batch} x {tp.grad_accum}, {attn}, set up in {record['setup_s']:.1f} s",
        flush=True,
    )

    n_steps = bench.warmup_steps + bench.timed_steps
    examples = workload(bench, n_steps * bench.step_rows, temperature, seed=1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_s, losses, norms = [], [], []
    for step in range(n_steps):
        first = step * bench.step_rows
        micro = [list(range(i, i + micro_batch)) for i in range(first, first + bench.step_rows, micro_batch)]
        sync(device)
        t0 = time.perf_counter()
        loss, norm = optimiser_step(engine, examples, micro, tp, autocast, attn == "flash_attention_2", device)
        sync(device)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss)
        norms.append(norm)
        phase = "warm-up" if step < bench.warmup_steps else "timed"
        print(
            f"[{name}] step {step + 1}/{n_steps} ({phase}) {step_s[-1]:.2f} s, loss {loss:.4g}, grad norm {norm:.3g}",
            flush=True,
        )
    timed_tokens = bench.timed_steps * bench.step_rows * bench.seq_len
    return record | {
        "tokens_per_s": timed_tokens / sum(step_s[bench.warmup_steps :]),
        "step_s": step_s,
        "losses": losses,
        "grad_norms": norms,
        **peak_memory(device),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name: str, argv: list[str], out: Path, bench: Bench, dry_run: bool) -> dict:
    """Run `name` in a child process (single-process DeepSpeed: rank 0 of 1); its record, or why it has none."""
    env = os.environ | {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    if dry_run:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator even where a GPU is present
    part = out / "runs" / f"{name.replace('/', '-')}.json"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu.ppo_bench", *argv, "--child", name]
    print(f"== {name}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=bench.run_timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"run": name, "error": f"did not finish in {bench.run_timeout_s} s"}
    if part.is_file():  # a record, or the error the run wrote before it failed
        return json.loads(part.read_text())
    return {"run": name, "error": f"its process exited with status {proc.returncode} (its output is above)"}


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def summarise(records: list[dict], bench: Bench, dry_run: bool) -> dict:
    """The JSON: every run's record, each compared with the anchor and with the plain loop of its weights."""
    by_name = {r["run"]: r for r in records}
    for r in records:
        if "tokens_per_s" not in r:
            continue
        plain = by_name.get(f"plain/{r['weights']}", {})
        r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"] if "tokens_per_s" in plain else None
        r["vs_anchor"] = None if dry_run else r["tokens_per_s"] / ANCHOR_TOKENS_PER_S  # tiny CPU shapes: no anchor
    return {
        "dry_run": dry_run,
        "device": next((r["device"] for r in records if "device" in r), None),
        "versions": {d: version(d) for d in ("torch", "transformers", "peft", "deepspeed")},
        "bench": dataclasses.asdict(bench),
        "anchor_tokens_per_s": ANCHOR_TOKENS_PER_S,
        "gpu_default_sizing": GPU_SIZING,
        "train": bench_params(bench, "full").train.model_dump(mode="json"),
        "runs": records,
        "loss_check": by_name.get("deepspeed/full", {}).get("loss_check"),
    }


def table(result: dict) -> str:
    b = result["bench"]
    lines = [
        f"{result['device']}: T={b['seq_len']}, LM head on the last {b['completion']} positions, "
        f"{b['step_rows']} sequences per optimiser step, {b['timed_steps']} timed steps after {b['warmup_steps']}",
        f"{'run':15} {'micro x acc':>11} {'ckpt':>4} {'tokens/s':>10} {'vs 35.0k':>8} {'vs plain':>8} {'peak GiB':>8}",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['run']:15} failed: {r['error']}")
            continue
        anchor = f"{r['vs_anchor']:.2f}x" if r["vs_anchor"] is not None else "n/a"
        plain = f"{r['vs_plain']:.2f}x" if r["vs_plain"] is not None else "n/a"
        ckpt = "yes" if r["activation_checkpointing"] else "no"
        lines.append(
            f"{r['run']:15} {r['micro_batch']:>6} x {r['grad_accum']:<2} {ckpt:>4} "
            f"{r['tokens_per_s']:10.0f} {anchor:>8} {plain:>8} {r['peak_mem_gib']:8.2f}"
        )
    check = result["loss_check"]
    if check is not None:
        lines.append(
            f"loss check ({check['rows']} x {b['seq_len']} tokens): fp32 {check['loss_fp32']:.6g}, "
            f"bf16 DeepSpeed {check['loss_bf16']:.6g}, relative difference {check['rel_diff']:.2e}; "
            f"|log-prob diff| mean {check['logp_abs_diff_mean']:.2e}, max {check['logp_abs_diff_max']:.2e}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder of ppo_bench.json (run.sh passes $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (DeepSpeed's CPU accelerator, gloo)")
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="a subset of the four runs")
    ap.add_argument(
        "--full-micro-batch", type=int, help=f"sequences per micro-batch, full (GPU {GPU.full_micro_batch})"
    )
    ap.add_argument(
        "--lora-micro-batch", type=int, help=f"sequences per micro-batch, LoRA (GPU {GPU.lora_micro_batch})"
    )
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every run")
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)  # one run, in the process `main` started
    return ap.parse_args(argv)


def bench_of(args: argparse.Namespace) -> Bench:
    """The preset (GPU or dry run) with the command line's overrides."""
    bench = DRY_RUN if args.dry_run else GPU
    overrides = {"full_micro_batch": args.full_micro_batch, "lora_micro_batch": args.lora_micro_batch}
    bench = dataclasses.replace(bench, **{k: v for k, v in overrides.items() if v is not None})
    if args.checkpointing:
        bench = dataclasses.replace(bench, checkpointing=True)
    for weights in WEIGHTS:
        micro = bench.micro_batch(weights)
        if micro < 1 or bench.step_rows % micro:
            raise SystemExit(
                f"--{weights}-micro-batch {micro} must divide the {bench.step_rows} sequences of an optimiser step"
            )
    return bench


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = bench_of(args)
    out: Path = args.out
    if args.child is not None:
        part = out / "runs" / f"{args.child.replace('/', '-')}.json"
        try:
            record = run_one(args.child, bench, args.dry_run)
        except torch.OutOfMemoryError as err:  # a micro-batch too big: the JSON and the table say so, the rest runs
            first_line = str(err).splitlines()[0]
            micro = bench.micro_batch(args.child.split("/")[1])
            record = {"run": args.child, "error": f"out of memory at micro-batch {micro}: {first_line}"}
            part.write_text(json.dumps(record, indent=2) + "\n")
            raise
        part.write_text(json.dumps(record, indent=2) + "\n")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: the GPU bench needs one (on CPU: bash bench/gpu/run.sh --dry-run)")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    child_argv = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    records = [spawn(name, child_argv, out, bench, args.dry_run) for name in RUNS if name in args.runs]
    result = summarise(records, bench, args.dry_run) | {"wall_s": time.perf_counter() - started}
    (out / "ppo_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out / 'ppo_bench.json'} ({result['wall_s']:.0f} s)")
    failed = [r["run"] for r in records if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)} (see above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
