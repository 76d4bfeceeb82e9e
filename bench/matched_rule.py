"""Is the loop's lift more than a stricter show rule? The base at the suggestion rate of each learned model.

    python -m bench.matched_rule --run bench/out/learning                    # defaults vs a stricter base
    python -m bench.matched_rule --run bench/out/learning-x --set paths.data_dir=bench/out/learning-x/corpus-data

bench/learning.py compares each setting's final model with the control (the base, unchanged) on held-out
editor traffic. The learnt models show fewer suggestions, and a stricter show rule (serving.min_logprob nearer 0)
alone also shows fewer, surer ones: part or all of a lift may be the loop finding a stricter operating point,
not learning which suggestions are right. This bench answers that. For each seed k of --setting it reads the
final model's held-out typing sessions (OUT/runs/SETTING-seedK.json) and types the base model through the same
held-out regions with the same seed's users and noise draws, bisecting min_logprob until the base's suggestion
rate is within --tolerance of the learnt model's (at most --steps typing runs per seed). The learnt models are
then compared with the base at the matched thresholds, paired as in bench/learning.py (95 % bootstrap over seeds
and typing sessions). A learnt model above the base's curve at the same suggestion rate (accept/shown, right
per shown, characters saved) learnt which suggestions to show; one on the curve only learnt to show fewer.

As a check, the base at params.yaml's threshold must reproduce the control's stored sessions (the same
evaluation): the bench says whether it does. Pass the learning run's own --set overrides (its --corpus data
dir, say) so the held-out regions and users are the same. Prints tables; writes OUT/matched_rule.json and
OUT/matched_rule.png (each seed's base curve over thresholds, the learnt models and the control as points).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.learning import TYPING, paired_differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a bench/learning.py --out dir (its runs/ are read)")
    parser.add_argument("--setting", default="defaults", help="the learnt setting to match (default: defaults)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="the learning run's overrides: section.key=value")
    parser.add_argument("--model", type=Path, help="the learning run's base checkpoint (default: model.base_dir)")
    parser.add_argument("--tolerance", type=float, default=0.005, help="suggestion-rate match, absolute")
    parser.add_argument("--steps", type=int, default=7, help="typing runs per seed at most (bisection)")
    parser.add_argument("--loosest", type=float, default=-3.0, help="the bisection's loosest min_logprob")
    args = parser.parse_args(argv)

    from tasks.core.config import load_params
    from tasks.core.generate import load_model

    params = load_params(args.params, args.set)
    stored = {s: [_stored(args.run, s, k) for k in range(args.seeds)] for s in (args.setting, "control")}
    lm = load_model(args.model or Path(params.model.base_dir))
    per_seed = [
        match_seed(lm, k, stored[args.setting][k], stored["control"][k], params, args) for k in range(args.seeds)
    ]
    report(per_seed, stored, args, params)
    return 0


def _stored(run: Path, setting: str, seed: int) -> list:
    path = run / "runs" / f"{setting}-seed{seed}.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no stored result; run bench/learning.py --out {run} with {setting} and seed {seed}")
    return json.loads(path.read_text())["sessions"]


def _summary(sessions: list, reward) -> dict:
    """The typing metrics of a list of sessions (six counts each; tasks/core/intervals.py)."""
    import numpy as np

    from tasks.core.intervals import metric_fns

    totals = np.asarray(sessions, dtype=float).reshape(-1, 6).sum(axis=0)
    return {k: float(f(totals)) for k, f in metric_fns(reward).items()}


def match_seed(lm, seed: int, learnt: list, control: list, params, args) -> dict:
    """Bisect min_logprob so the base's suggestion rate meets the learnt model's; every typing run is kept."""
    from tasks.core.config import load_params
    from tasks.core.inference import InProcess
    from tasks.sim.acceptance import type_regions
    from tasks.sim.editor import read_regions, regions_path

    default = params.serving.min_logprob
    if default is None:
        raise SystemExit("serving.min_logprob is null: the learning run had no show rule to make stricter")
    regions = read_regions(regions_path(params.paths.data_dir, "test"))

    def run_at(threshold: float) -> dict:
        at = load_params(args.params, [*args.set, f"simulator.seed={seed}", f"serving.min_logprob={threshold}"])
        run = type_regions(InProcess(lm), regions, at, desc=f"seed {seed}: base at min_logprob {threshold:+.4f}")
        sessions = [list(s) for s in run.sessions]
        return {"threshold": threshold, "sessions": sessions, **_summary(sessions, params.reward)}

    summary = _summary(learnt, params.reward)
    target = summary["suggest_rate"]
    runs = [run_at(default)]
    # suggestion rate falls as the threshold nears 0: the bracket that holds the learnt model's rate
    lo, hi = (default, 0.0) if runs[0]["suggest_rate"] > target else (args.loosest, default)
    while len(runs) < args.steps and abs(_nearest(runs, target)["suggest_rate"] - target) > args.tolerance:
        mid = (lo + hi) / 2
        runs.append(run_at(mid))
        lo, hi = (mid, hi) if runs[-1]["suggest_rate"] > target else (lo, mid)
    return {
        "seed": seed,
        "target": target,
        "reproduced_control": runs[0]["sessions"] == control,
        "learnt": summary,
        "control": _summary(control, params.reward),
        "runs": runs,
        "matched": _nearest(runs, target),
    }


def _nearest(runs: list[dict], target: float) -> dict:
    return min(runs, key=lambda r: abs(r["suggest_rate"] - target))


def report(per_seed: list[dict], stored: dict, args, params) -> None:
    from rich.table import Table

    from flows.cli.console import console, print_table
    from tasks.core.intervals import metric_fns

    fns = metric_fns(params.reward)
    table = Table(title=f"The base at each threshold tried vs the final models of {args.setting} (held-out traffic)")
    for col in ("seed", "model", "min_logprob", *TYPING):
        table.add_column(col, justify="right")
    for entry in per_seed:
        k = entry["seed"]
        table.add_row(str(k), args.setting, "-", *(f"{entry['learnt'][m]:.4f}" for m in TYPING))
        for run in sorted(entry["runs"], key=lambda r: r["threshold"]):
            mark = " (matched)" if run is entry["matched"] else ""
            table.add_row(str(k), "base", f"{run['threshold']:+.4f}{mark}", *(f"{run[m]:.4f}" for m in TYPING))
    print_table(table)
    for entry in per_seed:
        console.print(
            f"seed {entry['seed']}: the base at params.yaml's threshold "
            + ("reproduces" if entry["reproduced_control"] else "does NOT reproduce")
            + " the control's stored sessions",
            highlight=False,
        )

    comparisons = {
        "control (params.yaml threshold)": [e["runs"][0]["sessions"] for e in per_seed],
        "base at the matched threshold": [e["matched"]["sessions"] for e in per_seed],
    }
    diffs_table = Table(title=f"{args.setting} minus ... (paired 95 % intervals; * excludes 0)")
    diffs_table.add_column("against")
    for m in (*TYPING, "accept/shown, relative"):
        diffs_table.add_column(m, justify="right")
    numbers = {}
    for name, b in comparisons.items():
        diffs, rel, cells = paired_differences(stored[args.setting], b, fns)
        diffs_table.add_row(name, *cells)
        numbers[name] = {m: [d.value, d.low, d.high, d.excludes_zero] for m, d in diffs.items()}
        numbers[name]["accept_rate_relative"] = [rel.value, rel.low, rel.high, rel.excludes_zero]
    print_table(diffs_table)
    out = args.run / "matched_rule.json"
    out.write_text(
        json.dumps(
            {
                "setting": args.setting,
                "set": args.set,
                "differences": numbers,
                "seeds": [
                    {
                        "seed": e["seed"],
                        "target_suggest_rate": e["target"],
                        "reproduced_control": e["reproduced_control"],
                        "learnt": e["learnt"],
                        "base": [{k: v for k, v in r.items() if k != "sessions"} for r in e["runs"]],
                    }
                    for e in per_seed
                ],
            },
            indent=2,
        )
        + "\n"
    )
    _plot(per_seed, args.setting, args.run / "matched_rule.png")
    console.print(f"wrote {out} and {args.run / 'matched_rule.png'}")


def _plot(per_seed: list[dict], setting: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"accept_rate": "accept/shown", "right_rate": "right/shown (no noise)", "chars_saved": "characters saved"}
    fig, axes = plt.subplots(1, len(titles), figsize=(4.6 * len(titles), 4))
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        for entry in per_seed:
            k, runs = entry["seed"], sorted(entry["runs"], key=lambda r: r["suggest_rate"])
            line = ax.plot(
                [r["suggest_rate"] for r in runs], [r[key] for r in runs], ".-", alpha=0.7, label=f"base, seed {k}"
            )[0]
            learnt, control = entry["learnt"], entry["control"]
            ax.plot(
                learnt["suggest_rate"],
                learnt[key],
                "*",
                ms=12,
                color=line.get_color(),
                label=f"{setting}, seed {k}",
            )
            ax.plot(control["suggest_rate"], control[key], "s", color=line.get_color(), mfc="none")
        ax.set_xlabel("suggestion rate (stricter rule: left)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{setting}: final models (stars) vs the base over show-rule thresholds (squares: control)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
