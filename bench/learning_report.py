"""bench.learning's report: per-cycle and final tables with 95 % intervals, the timing table, results.json,
results.md and curves.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from bench.learning_runs import KEYS, TIMES, TYPING

if TYPE_CHECKING:
    from tasks.core.intervals import Interval


def _mean_spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def paired_differences(a: list, b: list, fns: dict) -> tuple[dict[str, Interval], Interval, list[str]]:
    """a - b for every TYPING metric and accept/shown relative (a / b - 1), paired 95 % intervals (seed k of a and
    of b typed the same held-out regions with the same users and noise draws), and their table cells
    (`*`: the interval excludes 0), the relative one last."""
    from tasks.core.intervals import difference

    diffs = {k: difference(a, b, fns[k], paired=True) for k in TYPING}
    rel = difference(a, b, fns["accept_rate"], relative=True, paired=True)
    star = lambda d: " *" if d.excludes_zero else ""  # noqa: E731
    cells = [f"{d.value:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{star(d)}" for d in diffs.values()]
    return diffs, rel, [*cells, f"{rel.value:+.1%} [{rel.low:+.1%}, {rel.high:+.1%}]{star(rel)}"]


def _numbers(diffs: dict[str, Interval]) -> dict[str, list]:
    """results.json's form of paired_differences' intervals: metric -> [value, low, high, excludes 0]."""
    return {k: [d.value, d.low, d.high, d.excludes_zero] for k, d in diffs.items()}


def final_table(finals: dict[str, list[list]], reward, seeds: list[int]) -> tuple[list[str], dict]:
    """Markdown rows: each setting's final metrics with 95 % intervals, and its difference from the control, over
    all seeds and (with more than one) each seed alone: the spread between seeds is most of a pooled interval."""
    from tasks.core.intervals import interval, metric_fns, pair_sessions

    fns = metric_fns(reward)
    lines = [
        "| setting | seeds | sessions | " + " | ".join(TYPING) + " |",
        "| --- | ---: | ---: |" + " ---: |" * len(TYPING),
    ]
    numbers: dict = {}
    for setting, per_seed in finals.items():
        cis = {k: interval(per_seed, fns[k]) for k in TYPING}
        numbers[setting] = {k: [c.value, c.low, c.high] for k, c in cis.items()}
        lines.append(
            f"| {setting} | {len(per_seed)} | {sum(map(len, per_seed))} | "
            + " | ".join(f"{c.value:.4f} [{c.low:.4f}, {c.high:.4f}]" for c in cis.values())
            + " |"
        )
    if "control" in finals:
        lines += [
            "",
            "| setting vs control | " + " | ".join(TYPING) + " | accept/shown, relative |",
            "| --- |" + " ---: |" * (len(TYPING) + 1),
        ]
        unpaired: list[str] = []
        for setting in (s for s in finals if s != "control"):
            # paired: seed k of every setting types the same held-out regions with the same users and noise draws
            a, b = finals[setting], finals["control"]
            diffs, rel, cells = paired_differences(a, b, fns)
            unpaired.append(f"{setting} {pair_sessions(a, b)[2]}")
            numbers[f"{setting} - control"] = _numbers(diffs)
            numbers[f"{setting} / control - 1, accept_rate"] = [rel.value, rel.low, rel.high, rel.excludes_zero]
            lines.append(f"| {setting} | " + " | ".join(cells) + " |")
            for i, seed in enumerate(seeds if len(seeds) > 1 else []):
                diffs, rel, cells = paired_differences([a[i]], [b[i]], fns)
                numbers[f"{setting} - control, seed {seed}"] = _numbers(diffs)
                lines.append(f"| {setting}, seed {seed} alone | " + " | ".join(cells) + " |")
        lines.append(
            "\n`*`: the 95 % interval excludes 0. Differences are paired (seed k of each setting typed the same "
            "held-out regions with the same users and noise draws; seeds and sessions resampled together); "
            f"tail sessions the request cap gave one side only, paired with an empty one: {', '.join(unpaired)}."
        )
    return lines, numbers


def report(curves, finals, base, args, params, seconds) -> None:
    from flows.cli.console import console

    cycle_table(curves, base, args)
    timing = timing_table(curves)
    if timing:
        console.print(
            "Wall time per cycle (mean over seeds, seconds): serving the traffic, training, the gate's evaluation"
        )
        console.print("\n".join(timing), highlight=False)
    seeds = args.reported_seeds
    lines, final = final_table({k: [f["unseen"] for f in v] for k, v in finals.items()}, params.reward, seeds)
    seen_lines, seen = final_table({k: [f["sessions"] for f in v] for k, v in finals.items()}, params.reward, seeds)
    unseen_title, seen_title = final_titles(args, params)
    console.print(unseen_title)
    console.print("\n".join(lines), highlight=False)
    console.print(seen_title)
    console.print("\n".join(seen_lines), highlight=False)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "base": base, "curves": curves}
    results |= {"final": final, "final_on_gate_requests": seen, "seconds": seconds}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    _plot(curves, final, base, args.out / "curves.png")
    (args.out / "results.md").write_text(
        "\n".join([_markdown(curves, base), *timing, "", unseen_title, "", *lines, "", seen_title, "", *seen_lines, ""])
    )
    console.print(f"wrote {args.out / 'results.json'}, results.md and curves.png ({seconds / 60:.1f} min)")


def cycle_table(curves, base, args) -> None:
    """The terminal's table: each setting's held-out numbers per cycle, mean and spread over seeds."""
    from rich.table import Table

    from flows.cli.console import print_table

    table = Table(
        title=f"held-out editor traffic per cycle (mean ± spread over seeds); base model: "
        f"accept/shown {base['accept_rate']:.3f}, suggest {base['suggest_rate']:.3f}, "
        f"chars saved {base['chars_saved']:.3f}"
    )
    table.add_column("setting")
    table.add_column("cycle", justify="right")
    table.add_column("window", justify="right")
    for key in KEYS:
        table.add_column(key, justify="right")
    for setting, seeds in curves.items():
        for cycle in range(args.final_cycle):
            cells = [_mean_spread([s[cycle][k] if s[cycle] else None for s in seeds]) for k in KEYS]
            table.add_row(setting, str(cycle + 1), _windows([s[cycle] for s in seeds]), *cells)
    print_table(table)


def final_titles(args, params) -> tuple[str, str]:
    """The titles of the final tables: on the unseen half, and on the gate's first window (the winner's curse)."""
    unseen_title = (
        f"After {args.final_cycle} cycles, the final model of each seed (seeds {args.reported_seeds}) typed through "
        "held-out regions no evaluation reached (value [95 % interval], bootstrap over seeds and typing sessions):"
    )
    seen_title = (
        "The same models on the gate's first held-out window (typed by cycle 1's gate, and by every gate when "
        "evaluate.gate_windows is 1), where gates chose them (optimistic: the winner's curse)"
        + (
            " and on into the next windows (--final-requests)"
            if (args.seen_requests or 0) > params.evaluate.n_requests
            else ""
        )
        + ":"
    )
    return unseen_title, seen_title


def timing_table(curves) -> list[str]:
    """Markdown rows: each online setting's mean seconds per cycle (over seeds) spent on serving, training and
    evaluation, and the whole cycle (traffic + cycle flow). Runs stored before timing was recorded have none."""
    lines = []
    for setting, seeds in curves.items():
        for cycle in range(len(seeds[0])):
            times = [s[cycle]["time"] for s in seeds if s[cycle] and "time" in s[cycle]]
            if times:
                mean = {k: statistics.mean(t[k] for t in times) for k in TIMES}
                total = mean["traffic_s"] + mean["cycle_s"]
                cells = [
                    f"{mean['traffic_s']:.0f}",
                    f"{mean['train_s']:.0f}",
                    f"{mean['evaluate_s']:.0f}",
                    f"{total:.0f}",
                ]
                lines.append(f"| {setting} | {cycle + 1} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    return [
        "| setting | cycle | serving | training | evaluation | whole cycle |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *lines,
    ]


def _markdown(curves, base) -> str:
    """The per-cycle table as Markdown (mean ± spread over seeds), for a lab note (docs/lab/)."""
    lines = [
        "| setting | seeds | cycle | window | " + " | ".join(KEYS) + " |",
        "| --- | ---: | ---: | ---: |" + " ---: |" * len(KEYS),
        "| base | - | 0 | 0 | " + " | ".join(f"{base[k]:.3f}" for k in KEYS) + " |",
    ]
    for setting, seeds in curves.items():
        for cycle in range(len(seeds[0])):
            cells = [_mean_spread([s[cycle][k] if s[cycle] else None for s in seeds]) for k in KEYS]
            window = _windows([s[cycle] for s in seeds])
            lines.append(f"| {setting} | {len(seeds)} | {cycle + 1} | {window} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _windows(entries: list[dict]) -> str:
    """The gate windows the seeds' entries of one cycle were typed through: `1`, or `0/1` where seeds differ
    (a cycle that gated nothing repeats its model's last numbers, on that gate's window)."""
    return "/".join(str(w) for w in sorted({e.get("window") for e in entries if e and "window" in e})) or "-"


def _plot(curves, final, base, path: Path) -> None:
    """Top row: mean per cycle with the seeds' spread as a band; at the last cycle, the bootstrap 95 % interval on
    unseen requests. Bottom row (with a control): each setting minus the control, seed by seed on the same window
    (what the windows' difficulty does to both cancels), and the paired interval of the final difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("accept_rate", "right_rate", "suggest_rate", "chars_saved")
    control = curves.get("control")
    lifts = {k: v for k, v in curves.items() if k != "control"} if control else {}
    rows = 2 if lifts else 1
    fig, axes = plt.subplots(rows, len(keys), figsize=(4.6 * len(keys), 4 * rows), squeeze=False)
    colors = {setting: f"C{i}" for i, setting in enumerate(curves)}
    for ax, key in zip(axes[0], keys, strict=True):
        for i, (setting, seeds) in enumerate(curves.items()):
            per_cycle = [[base[key]]] + [[s[c][key] for s in seeds if s[c]] for c in range(len(seeds[0]))]
            _band(ax, per_cycle, setting, colors[setting], final.get(setting, {}).get(key), i)
        _axes(ax, key, "cycle (0 = base; square = final, unseen requests, 95 % CI)")
    for ax, key in zip(axes[1], keys, strict=True) if lifts else []:
        for i, (setting, seeds) in enumerate(lifts.items()):
            pairs = list(zip(seeds, control, strict=False))  # seed k with seed k
            n = len(seeds[0])
            per_cycle = [[0.0]] + [[s[c][key] - b[c][key] for s, b in pairs if s[c] and b[c]] for c in range(n)]
            _band(ax, per_cycle, setting, colors[setting], final.get(f"{setting} - control", {}).get(key), i)
        ax.axhline(0.0, color="grey", lw=0.8)
        _axes(ax, f"{key} minus control", "cycle (square = final, unseen requests, paired 95 % CI)")
    fig.suptitle(
        "each cycle typed through its gate's window of held-out regions; the control through the same", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _band(ax, per_cycle: list[list[float]], label: str, color: str, final: list | None, i: int) -> None:
    """Mean per cycle, the seeds' spread as a band, and the final interval as a square with error bars."""
    means = [statistics.mean(v) if v else float("nan") for v in per_cycle]
    lows = [min(v) if v else float("nan") for v in per_cycle]
    highs = [max(v) if v else float("nan") for v in per_cycle]
    x = range(len(per_cycle))
    ax.plot(x, means, "o-", label=label, color=color)
    ax.fill_between(x, lows, highs, color=color, alpha=0.15)
    if final is not None:
        value, low, high = final[:3]
        ax.errorbar(
            [len(per_cycle) - 1 + 0.15 + 0.1 * i],
            [value],
            yerr=[[value - low], [high - value]],
            fmt="s",
            color=color,
            capsize=3,
        )


def _axes(ax, title: str, xlabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
