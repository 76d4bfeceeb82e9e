"""Would stopping where the model is unsure help users? A decoding rule, measured, not built into serving.

    python bench/stop_rule.py                                   # the shipped base, 1000 requests
    python bench/stop_rule.py --model DIR --requests 500 --thresholds -1 -2 -3

Each held-out request (every pause of the first test-file regions, no Tab taken: the model-free
request set of `bench/headroom.py`) gets the model's greedy suggestion with the log-prob of each of
its tokens. For a threshold t the suggestion is cut before its first token whose log-prob is below t
(nothing left: no suggestion). For each t: suggestion rate, right per request and per shown suggestion
(the simulated user's noise-free rule, K = 4), the accept/shown the default personas would give (right
plus their noise on the wrong ones) and characters saved (the characters a right suggestion covers,
over all the requests' true continuations; a model-free set, so the typing loop's jump is not modelled).
"none" is the greedy suggestion as served today.
Prints a table, writes bench/out/stop_rule/results.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: model.base_dir)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--split", choices=("test", "train"), default="test", help="held-out or traffic regions")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[-0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -4.0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/stop_rule"))
    args = parser.parse_args(argv)

    from rich.table import Table
    from tqdm import tqdm

    from tasks.acceptance import noise_floor
    from tasks.config import load_params
    from tasks.console import console, print_table
    from tasks.editor import covered_chars, pause_requests, read_regions, regions_path
    from tasks.fim import parse_completion
    from tasks.generate import generate, load_model, stops_of
    from tasks.simulated_users import is_right

    params = load_params(args.params, args.set)
    model_dir = args.model or Path(params.model.base_dir)
    lm = load_model(model_dir)
    regions = read_regions(regions_path(params.paths.data_dir, args.split))
    requests = list(itertools.islice((q for r in regions for q in pause_requests(r, params.traffic)), args.requests))
    stops = stops_of(lm.template, lm.tokenizer)
    batch = params.evaluate.batch_size
    gens = []
    for start in tqdm(range(0, len(requests), batch), desc="greedy with log-probs", unit="batch"):
        chunk = requests[start : start + batch]
        prompts = [lm.template.render(q["prefix"], q["suffix"]) for q in chunk]
        gens.extend(generate(*lm, prompts, params.evaluate.max_new_tokens))

    def cut(gen, threshold: float | None) -> str:
        if threshold is None:
            return gen.text
        keep = next((i for i, lp in enumerate(gen.logprobs) if lp < threshold), len(gen.logprobs))
        return parse_completion(lm.tokenizer.decode(gen.token_ids[:keep], skip_special_tokens=False), stops)

    floor = noise_floor(params.simulator)
    typed = sum(len(q["middle"]) for q in requests)
    rows = []
    for threshold in [None, *args.thresholds]:
        texts = [cut(g, threshold) for g in gens]
        shown = [(t, q) for t, q in zip(texts, requests, strict=True) if t.strip()]
        right = [(t, q) for t, q in shown if is_right(t, q["middle"], 4)]
        n_shown, n_right = len(shown), len(right)
        rows.append(
            {
                "threshold": threshold,
                "requests": len(requests),
                "suggest_rate": n_shown / len(requests),
                "right_per_request": n_right / len(requests),
                "right_per_shown": n_right / n_shown if n_shown else 0.0,
                "accept_per_shown": (n_right + floor * (n_shown - n_right)) / n_shown if n_shown else 0.0,
                "chars_saved": sum(covered_chars(q["middle"], t) for t, q in right) / typed,
            }
        )
    table = Table(
        title=f"Cut at the first token below a log-prob ({Path(model_dir).name}, {len(requests)} {args.split} requests)"
    )
    for col in ("threshold", "suggest rate", "right/request", "right/shown", "accept/shown (personas)", "chars saved"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            "none" if r["threshold"] is None else f"{r['threshold']:g}",
            f"{r['suggest_rate']:.3f}",
            f"{r['right_per_request']:.4f}",
            f"{r['right_per_shown']:.4f}",
            f"{r['accept_per_shown']:.4f}",
            f"{r['chars_saved']:.4f}",
        )
    print_table(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"model": str(model_dir), "split": args.split, "rows": rows}, indent=2) + "\n"
    )
    console.print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
