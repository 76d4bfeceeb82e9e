"""Which base size buys most per CPU hour?  Pre-train several shapes for the same wall-clock budget.

    python -m bench.base_size                             # 3 shapes, 600 s each, 200 held-out requests
    python -m bench.base_size --budget-s 1800 --shapes 128x4 256x4 --requests 300

Each shape (HIDDENxLAYERS; heads of 64 dims, half as many KV heads, MLP 2.75x hidden) is timed for a
few real pre-training steps on this machine, given the number of steps that fills the budget, and
built with `build_base` (the same tokenizer, samples and schedule as the shipped base; only the shape
and `model.pretrain_steps` differ). Each result is scored on held-out editor traffic (test files):
the loss of the true continuation at each pause (nats per middle token, what more training lowers
first) and the headroom right rates (``tasks.sim.acceptance.headroom``). Run it on a quiet machine: the
budget is wall-clock.

Prints a table, writes bench/out/base_size/results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def shape(spec: str) -> dict:
    """'256x4' -> the model params of that shape."""
    hidden, layers = (int(x) for x in spec.lower().split("x"))
    heads = max(1, hidden // 64)
    return {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": max(1, heads // 2),
        "intermediate_size": int(hidden * 2.75) // 32 * 32,
    }


def seconds_per_step(model_params, vocab: int, steps: int = 4) -> float:
    """Wall-clock of one pre-training step of this shape (random tokens of the full batch and length)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=model_params.hidden_size,
        intermediate_size=model_params.intermediate_size,
        num_hidden_layers=model_params.num_layers,
        num_attention_heads=model_params.num_heads,
        num_key_value_heads=model_params.num_kv_heads,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (model_params.pretrain_batch, model_params.pretrain_seq_len))
    for i in range(steps + 1):
        if i == 1:
            started = time.perf_counter()  # the first step warms the allocator up
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["128x4", "192x4", "256x4"], help="HIDDENxLAYERS")
    parser.add_argument("--budget-s", type=float, default=600.0, help="pre-training wall-clock per shape")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus/files.parquet"))
    parser.add_argument("--requests", type=int, default=200, help="held-out editor requests per score")
    parser.add_argument("--k", type=int, default=4, help="samples per request for pass@k")
    parser.add_argument("--out", type=Path, default=Path("bench/out/base_size"))
    args = parser.parse_args(argv)

    from rich.table import Table

    from flows.cli.console import console, print_table
    from tasks.core.config import load_params
    from tasks.sim.acceptance import headroom
    from tasks.sim.corpus import read_corpus
    from tasks.sim.editor import read_regions, regions_path
    from tasks.train.base import build_base

    params = load_params(args.params, args.set)
    train_files = read_corpus(args.corpus)["train"]
    regions = read_regions(regions_path(params.paths.data_dir, "test"))
    results = []
    for spec in args.shapes:
        model_params = params.model.model_copy(update=shape(spec))
        per_step = seconds_per_step(model_params, params.model.vocab_size)
        steps = max(1, int(args.budget_s / per_step))
        model_params = model_params.model_copy(update={"pretrain_steps": steps})
        out = args.out / spec
        console.print(f"{spec}: {per_step:.2f} s/step here -> {steps} steps in {args.budget_s:.0f} s")
        stats = build_base(train_files, model_params, params.fim, params.traffic, out)
        h = headroom(out, regions, params, args.requests, k=args.k)
        results.append(
            {
                "shape": spec,
                "parameters": stats["parameters"],
                "steps": steps,
                "tokens": round(stats["pretrain_tokens_per_step_mean"] * steps),
                "build_seconds": stats["seconds_this_run"],
                **h.as_dict(),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    title = f"Base shapes at {args.budget_s:.0f} s of pre-training each ({args.requests} held-out requests)"
    table = Table(title=title)
    for col in ("shape", "params", "steps", "tokens", "build s", "middle loss", "right greedy", f"pass@{args.k}"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r["shape"],
            f"{r['parameters'] / 1e6:.2f}M",
            str(r["steps"]),
            f"{r['tokens'] / 1e6:.1f}M",
            f"{r['build_seconds']:.0f}",
            f"{r['middle_loss']:.3f}",
            f"{r['greedy_right']:.3f}",
            f"{r['pass_at_k']:.3f}",
        )
    print_table(table)
    console.print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
