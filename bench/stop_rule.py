"""Does stopping where the model is unsure help users? The show rule (serving.min_logprob), measured per threshold.

    python -m bench.stop_rule                                   # the shipped base, 1000 requests
    python -m bench.stop_rule --model DIR --requests 500 --thresholds -1 -2 -3

Each held-out request (every pause of the first test-file regions, no Tab taken: the model-free
request set of `bench/headroom.py`) gets the model's greedy suggestion with the log-prob of each of
its tokens. For a threshold t the suggestion is cut before its first token whose log-prob is below t
(nothing left: no suggestion). For each t: suggestion rate, right per request and per shown suggestion
(the simulated user's noise-free rule, K = 4), the accept/shown the default personas would give (right
plus their noise on the wrong ones) and characters saved (the characters a right suggestion covers,
over all the requests' true continuations; a model-free set, so the typing loop's jump is not modelled).
"none" is the greedy suggestion whole.

--typing measures the rule as shipped instead (serving.min_logprob, tasks/core/generate.py ShowRule): the held-out
evaluation itself (simulated users type the regions, Tab moves the cursor, greedy, log-probs under the
serving temperature) once per threshold, with 95 % intervals over typing sessions.
Prints a table, writes bench/out/stop_rule/results.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: model.base_dir)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--split", choices=("test", "train"), default="test", help="held-out or traffic regions")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (log-probs at T = 1); else sampled")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[-0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -4.0])
    parser.add_argument("--typing", action="store_true", help="run the held-out typing evaluation per threshold")
    parser.add_argument("--out", type=Path, default=Path("bench/out/stop_rule"))
    args = parser.parse_args(argv)
    if args.typing:
        return typing(args)

    from tqdm import tqdm

    from flows.cli.console import console
    from tasks.core.config import load_params
    from tasks.core.generate import ShowRule, cut_unsure, generate, load_model, stops_of
    from tasks.sim.acceptance import noise_floor
    from tasks.sim.editor import pause_requests, read_regions, regions_path
    from tasks.sim.sessions import covered_chars
    from tasks.sim.users import is_right

    params = load_params(args.params, args.set)
    model_dir = args.model or Path(params.model.base_dir)
    lm = load_model(model_dir)
    regions = read_regions(regions_path(params.paths.data_dir, args.split))
    requests = list(itertools.islice((q for r in regions for q in pause_requests(r, params.traffic)), args.requests))
    stops = stops_of(lm.template, lm.tokenizer)
    batch = params.evaluate.batch_size
    gens = []
    for start in tqdm(range(0, len(requests), batch), desc="generate with log-probs", unit="batch"):
        chunk = requests[start : start + batch]
        prompts = [lm.template.render(q["prefix"], q["suffix"]) for q in chunk]
        gens.extend(generate(*lm, prompts, params.evaluate.max_new_tokens, temperature=args.temperature, seed=start))

    def cut(gen, threshold: float | None) -> str:
        """The text the show rule leaves of gen (its log-probs: those it was generated with)."""
        keep = (
            None
            if threshold is None
            else ShowRule(threshold, 1.0).first_unsure(gen.logprobs, gen.finish_reason == "stop")
        )
        if keep is None:
            return gen.text
        return cut_unsure(gen, keep, lm.tokenizer.decode(gen.token_ids[:keep], skip_special_tokens=False), stops).text

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
    title = f"Cut at the first token below a log-prob ({Path(model_dir).name}, {len(requests)} {args.split} requests"
    columns = ("threshold", "suggest rate", "right/request", "right/shown", "accept/shown (personas)", "chars saved")
    cells = [
        (f"{r['right_per_request']:.4f}", f"{r['right_per_shown']:.4f}", f"{r['accept_per_shown']:.4f}")
        + (f"{r['chars_saved']:.4f}",)
        for r in rows
    ]
    print_rows(f"{title}, T = {args.temperature:g})", columns, rows, cells)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {"model": str(model_dir), "split": args.split, "temperature": args.temperature, "rows": rows}, indent=2
        )
        + "\n"
    )
    console.print(f"wrote {args.out / 'results.json'}")
    return 0


DIFF = "{value:+.4f} [{low:+.4f}, {high:+.4f}]"


def print_rows(title: str, columns: tuple[str, ...], rows: list[dict], cells: list[tuple[str, ...]]) -> None:
    """A table of one row per threshold: the threshold, its suggestion rate, then the given cells."""
    from rich.table import Table

    from flows.cli.console import print_table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for r, rest in zip(rows, cells, strict=True):
        table.add_row("none" if r["threshold"] is None else f"{r['threshold']:g}", f"{r['suggest_rate']:.3f}", *rest)
    print_table(table)


def typing(args: argparse.Namespace) -> int:
    """The typing evaluation (tasks/sim/acceptance.type_regions) once per serving.min_logprob."""

    from flows.cli.console import console
    from tasks.core.config import load_params
    from tasks.core.generate import load_model
    from tasks.core.inference import InProcess
    from tasks.core.intervals import difference, metric_fns
    from tasks.sim.acceptance import type_regions
    from tasks.sim.editor import read_regions, regions_path

    base = load_params(args.params, args.set)
    model_dir = args.model or Path(base.model.base_dir)
    lm = load_model(model_dir)
    regions = read_regions(regions_path(base.paths.data_dir, args.split))
    metrics = metric_fns(base.reward)
    rows, whole = [], None
    for threshold in [None, *args.thresholds]:
        rule = "null" if threshold is None else threshold
        params = load_params(
            args.params, [*args.set, f"serving.min_logprob={rule}", f"evaluate.n_requests={args.requests}"]
        )
        run = type_regions(InProcess(lm), regions, params, desc=f"type, min_logprob {rule}")
        whole = whole or [run.sessions]  # the first run: every suggestion shown whole
        vs = {m: difference([run.sessions], whole, metrics[m], paired=True) for m in ("accept_rate", "chars_saved")}
        rows.append(
            {"threshold": threshold, **run.summary.as_dict(), **{f"{m}_vs_none": vars(i) for m, i in vs.items()}}
        )
    columns = ("min_logprob", "suggest rate", "accept/shown", "right/shown", "chars saved")
    columns += ("accept/shown - none [95 %]", "chars saved - none [95 %]")
    cells = [
        (f"{r['accept_rate']:.4f}", f"{r['right_rate']:.4f}", f"{r['chars_saved']:.4f}")
        + tuple(
            "{value:+.4f} [{low:+.4f}, {high:+.4f}]".format(**r[f"{m}_vs_none"]) for m in ("accept_rate", "chars_saved")
        )
        for r in rows
    ]
    title = f"The show rule in the typing evaluation ({Path(model_dir).name}, {args.requests} {args.split} requests"
    print_rows(f"{title}, greedy, log-probs at T = {base.serving.temperature:g})", columns, rows, cells)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "typing.json").write_text(
        json.dumps({"model": str(model_dir), "split": args.split, "rows": rows}, indent=2) + "\n"
    )
    console.print(f"wrote {args.out / 'typing.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
