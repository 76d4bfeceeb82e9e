"""What ending a generation at its first unsure token saves (issue 54): the same held-out typing sessions typed in
process twice in one run, decoding on to evaluate.max_new_tokens and cut afterwards (as before a484b90), then ending
each row at its first unsure token under the show rule (`tasks.core.stopping.StopAtUnsure`, switched off for the
first run by making it answer "go on" for every row).

    python -m bench.stop_at_unsure [--model models/tabrl-tiny] [--requests 300] [--set section.key=value ...]
    bench/emulate_slow.sh --cores 0.6 -- python -m bench.stop_at_unsure      # on the emulated slow machine

The gate's requests (window 0 of the held-out regions, greedy, the shipped rule) by default; with --real-model,
bench.inference's setting (the CPU and real-model overlays, 4000-character prefixes, the corpus's test files).
Per run: seconds, requests/s, the model's forwards and row-steps (a hook on its output layer), and what the users
did, which must be the same in both. Prints a table, writes bench/out/stop_at_unsure.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench import CPU_OVERLAY
from flows.cli.console import console
from tasks.core import generate, stopping
from tasks.core.config import load_params
from tasks.core.inference import InProcess
from tasks.core.machine import describe
from tasks.sim.acceptance import gate_regions, type_regions
from tasks.sim.corpus import read_corpus
from tasks.sim.editor import pick_regions, read_regions, regions_path


def _go_on(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
    return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def type_once(lm, regions, params, stop_at_unsure: bool) -> dict:
    """One typing run: its speed, the forwards it took and what the users did."""
    original = stopping.StopAtUnsure.__call__
    if not stop_at_unsure:
        stopping.StopAtUnsure.__call__ = _go_on  # type: ignore[method-assign]
    rows: list[int] = []
    hook = lm.model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: rows.append(out.shape[0]))
    try:
        started = time.perf_counter()
        typed = type_regions(InProcess(lm), regions, params)
        seconds = time.perf_counter() - started
    finally:
        hook.remove()
        stopping.StopAtUnsure.__call__ = original  # type: ignore[method-assign]
    s = typed.summary
    return {
        "seconds": seconds,
        "requests_per_s": s.requests / seconds,
        "forwards": len(rows),
        "row_steps": sum(rows),
        "users": {"accepted": s.accepted, "rejected": s.rejected, "abstained": s.abstained, "saved": s.saved_chars},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/tabrl-tiny"))
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--requests", type=int, default=300, help="typing requests per run")
    parser.add_argument("--real-model", action="store_true", help="bench.inference's setting (SmolLM2 overlays)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/stop_at_unsure.json"))
    args = parser.parse_args(argv)
    sets = [f"evaluate.n_requests={args.requests}"]
    if args.real_model:
        sets += ["traffic.max_prefix_chars=4000", f"@{CPU_OVERLAY}", "@params.real-model.yaml"]
    params = load_params(args.params, [*sets, *args.set, "serving.backend=embedded"])
    if args.real_model:
        test = read_corpus(Path(params.data.source))["test"]
        regions = pick_regions(test, 120, params.traffic, params.fim.seed, "bench-inference")
    else:
        held_out = read_regions(regions_path(params.paths.data_dir, "test"))
        regions = gate_regions(held_out, 0, params.evaluate.gate_windows)
    lm = generate.load_model(args.model)
    runs = {
        "whole, cut after": type_once(lm, regions, params, False),
        "ends at unsure": type_once(lm, regions, params, True),
    }
    before, after = runs.values()
    result = {"machine": describe(params).as_dict(), "model": str(args.model), "requests": args.requests, "runs": runs}
    result["speed_ratio"] = after["requests_per_s"] / before["requests_per_s"]
    result["same_users"] = before["users"] == after["users"]
    for label, run in runs.items():
        console.print(
            f"{label:>18}: {run['seconds']:7.1f} s  {run['requests_per_s']:6.2f} req/s  {run['forwards']:5d} forwards  "
            f"{run['row_steps']:6d} row-steps  users {run['users']}",
            highlight=False,
        )
    console.print(f"speed ratio {result['speed_ratio']:.2f}x; the users did the same: {result['same_users']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["same_users"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
