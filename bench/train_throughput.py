"""Training throughput: tabrl's update (packed rows, LM head on completion positions only) vs a plain loop.

    python -m bench.train_throughput            # GPU: Qwen2.5-Coder-1.5B shapes, random init, bf16 autocast
    python -m bench.train_throughput --cpu      # CPU: tiny shapes, same table

The plain loop pads each micro-batch to its longest sequence and runs the full-vocabulary
log-softmax over every position. Both use the same model, data, loss (tasks/train/loss.py) and
AdamW, one process, in one run. Workloads: (a) fixed length T with 128 completion tokens;
(b) a length mix: prompt lengths uniform in [T/8, T - 128], completions uniform in [16, 128].
Tokens/s counts real tokens (prompt + completion, padding excluded); MFU = 6 * params * tokens/s
/ peak (H100 dense bf16: 989 TFLOP/s; not reported on CPU). Writes bench/out/train_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from tasks.train.batching import Example, pack
from tasks.train.engines import CompletionPolicy, token_logp
from tasks.train.loss import ppo_loss

SHAPES = {
    "qwen2.5-coder-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    ),
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
}
H100_BF16_FLOPS = 989e12


def workload(kind: str, n: int, T: int, vocab: int, rng: random.Random) -> list[Example]:
    out = []
    for _ in range(n):
        if kind == "fixed":
            n_prompt, n_comp = T - 128, 128
        else:
            n_prompt, n_comp = rng.randint(T // 8, T - 128), rng.randint(16, 128)
        ids = [rng.randrange(10, vocab) for _ in range(n_prompt + n_comp)]
        out.append(Example(ids, n_prompt, rng.choice([0.75, -0.25]), 0.7, None))
    return out


def tabrl_step(policy, examples, idx, one_row, device):
    batch = pack(examples, idx, one_row=one_row).to(device)
    logits = policy(batch.input_ids, batch.position_ids, batch.gather_idx)  # (N, V) completion positions only
    logp, _ = token_logp(logits, batch.targets, batch.inv_temp)
    adv = torch.cat([torch.full((examples[i].n_completion,), examples[i].advantage) for i in batch.example_idx]).to(
        device
    )
    loss, _ = ppo_loss(logp, logp.detach(), adv, torch.ones_like(logp), clip_low=0.2, clip_high=0.28)
    return loss


def plain_step(model, examples, idx, device):
    width = max(len(examples[i].input_ids) for i in idx)
    ids = torch.zeros((len(idx), width), dtype=torch.long)
    attn = torch.zeros((len(idx), width), dtype=torch.long)
    comp = torch.zeros((len(idx), width), dtype=torch.float32)
    adv = torch.zeros((len(idx), width), dtype=torch.float32)
    for r, i in enumerate(idx):
        ex = examples[i]
        ids[r, : len(ex.input_ids)] = torch.tensor(ex.input_ids)
        attn[r, : len(ex.input_ids)] = 1
        comp[r, ex.n_prompt : len(ex.input_ids)] = 1  # targets at t+1 -> shift below
        adv[r] = ex.advantage
    ids, attn, comp, adv = ids.to(device), attn.to(device), comp.to(device), adv.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, W-1, V) every position
    logz = F.log_softmax(logits.float() / 0.7, dim=-1)
    logp = logz.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, W-1)
    loss, _ = ppo_loss(logp, logp.detach(), adv[:, 1:], comp[:, 1:], clip_low=0.2, clip_high=0.28)
    return loss


def run(name, step_fn, module, examples, micro, steps, device, autocast):
    opt = torch.optim.AdamW(module.parameters(), lr=1e-6)
    order = list(range(len(examples)))
    batches = [order[i : i + micro] for i in range(0, len(order), micro)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens, started = 0, None
    for k, idx in enumerate(batches[: steps + 1]):
        if k == 1:  # the first step warms up kernels and allocator
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = step_fn(idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= 1:
            tokens += sum(len(examples[i].input_ids) for i in idx)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"method": name, "tokens_per_s": tokens / seconds, "peak_mem_gib": peak / 2**30, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--micro", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--T", type=int, default=None)
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    shape = "qwen2.5-coder-1.5b" if gpu else "tiny"
    T = args.T or (1024 if gpu else 512)
    micro = args.micro or (16 if gpu else 8)
    steps = args.steps or (8 if gpu else 4)
    flash = gpu and __import__("importlib").util.find_spec("flash_attn") is not None
    torch.manual_seed(0)
    config = Qwen2Config(
        **SHAPES[shape], tie_word_embeddings=not gpu, attn_implementation="flash_attention_2" if flash else "sdpa"
    )
    model = Qwen2ForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    policy = CompletionPolicy(model)
    rows = []
    for kind in ("fixed", "mix"):
        examples = workload(kind, micro * (steps + 1), T, config.vocab_size, random.Random(1))
        for name, fn, module in (
            ("tabrl", lambda idx, examples=examples: tabrl_step(policy, examples, idx, flash, device), policy),
            ("plain", lambda idx, examples=examples: plain_step(model, examples, idx, device), model),
        ):
            r = run(name, fn, module, examples, micro, steps, device, autocast=gpu)
            r |= {"workload": kind, "mfu": 6 * n_params * r["tokens_per_s"] / H100_BF16_FLOPS if gpu else None}
            rows.append(r)
    print(
        f"{shape} ({n_params / 1e6:.1f}M params) on {device}, T={T}, micro-batch {micro}, {steps} timed steps, "
        f"attention {'flash varlen' if flash else 'sdpa'}"
    )
    print(f"{'workload':8} {'method':6} {'tokens/s':>10} {'vs plain':>8} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        base = next(x for x in rows if x["workload"] == r["workload"] and x["method"] == "plain")
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(
            f"{r['workload']:8} {r['method']:6} {r['tokens_per_s']:10.0f} {r['speedup']:7.2f}x {mfu:>6} "
            f"{r['peak_mem_gib']:9.2f}"
        )
    out = Path("bench/out/train_throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": shape, "device": str(device), "T": T, "micro": micro, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
