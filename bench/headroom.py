"""Right rate vs pre-training steps: the headroom of each saved checkpoint on held-out editor traffic.

    tabrl build-base --snapshots                     # keeps models/tabrl-tiny.partial/step-N
    python -m bench.headroom                         # every step-N there, 300 requests, pass@8
    python -m bench.headroom --models A B --requests 500

For each checkpoint: suggestion rate and right rate greedy (pass@1), right rate sampled at the
serving temperature, pass@k, beside the noise floor, and the loss of the true continuation (nats per
token; smooth where a few hundred requests' right rates are not) (``tasks.sim.acceptance.headroom``). All on the
model-free request set: every pause of the first held-out regions (test files), no Tab taken.
Prints a table, writes bench/out/headroom/results.json and curve.png.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _steps(path: Path, built_steps: int | None = None) -> int:
    """Pre-training steps of a checkpoint: N of `step-N`, else built_steps for the finished base, else -1."""
    found = re.search(r"step-(\d+)$", path.name)
    if found:
        return int(found.group(1))
    return built_steps if built_steps is not None else -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", nargs="*", type=Path, help="checkpoint dirs (default: models/tabrl-tiny.partial/step-*)"
    )
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override: section.key=value")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/out/headroom"))
    args = parser.parse_args(argv)

    from rich.table import Table

    from flows.cli.console import console, print_table
    from tasks.core.config import load_params
    from tasks.sim.acceptance import headroom
    from tasks.sim.editor import read_regions, regions_path

    params = load_params(args.params, args.set)
    models = args.models or sorted((ROOT / "models" / "tabrl-tiny.partial").glob("step-*"), key=_steps)
    if not models:
        parser.error("no checkpoints: pass --models or run `tabrl build-base --snapshots` first")

    def built(model: Path) -> int | None:  # the finished base was pre-trained for model.pretrain_steps
        return params.model.pretrain_steps if model.resolve() == Path(params.model.base_dir).resolve() else None

    regions = read_regions(regions_path(params.paths.data_dir, "test"))
    results = []
    for model in models:
        started = time.time()
        h = headroom(model, regions, params, args.requests, k=args.k)
        results.append(
            {
                "model": str(model),
                "steps": _steps(model, built(model)),
                **h.as_dict(),
                "seconds": round(time.time() - started, 1),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    table = Table(title=f"Headroom on held-out editor traffic ({args.requests} requests, K=4, noise-free rule)")
    for col in (
        "model",
        "steps",
        "suggest (greedy)",
        "right/request greedy",
        "right/shown greedy",
        "right if cut (greedy)",
        f"right/request T={params.serving.temperature}",
        f"pass@{args.k}",
        "noise floor",
        "middle loss",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            Path(r["model"]).name,
            str(r["steps"]),
            f"{r['greedy_shown']:.3f}",
            f"{r['greedy_right']:.3f}",
            f"{r['greedy_right_per_shown']:.3f}",
            f"{r['greedy_right_if_cut']:.3f}",
            f"{r['sampled_right']:.3f}",
            f"{r['pass_at_k']:.3f}",
            f"{r['noise_floor']:.4f}",
            f"{r['middle_loss']:.3f}",
        )
    print_table(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot([r for r in results if r["steps"] >= 0], args.out / "curve.png", args.k)
    console.print(f"wrote {args.out / 'results.json'} and curve.png")
    return 0


def _plot(results: list[dict], path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        return
    steps = [r["steps"] for r in results]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (
        ("greedy_right", "right / request, greedy"),
        ("sampled_right", "right / request, sampled"),
        ("pass_at_k", f"pass@{k}"),
        ("greedy_right_per_shown", "right / shown, greedy"),
        ("greedy_right_if_cut", "right / request, greedy cut at its best point"),
    ):
        ax.plot(steps, [r[key] for r in results], "o-", label=label)
    ax.axhline(results[0]["noise_floor"], color="gray", ls="--", label="noise floor (accept/shown)")
    ax.set_xlabel("pre-training steps")
    ax.set_ylabel("rate")
    ax.set_title("tabrl-tiny headroom on held-out editor traffic")
    ax.grid(alpha=0.3)
    loss_ax = ax.twinx()
    loss_ax.plot(
        steps, [r["middle_loss"] for r in results], "k:", marker="s", label="middle loss (nats/token, right axis)"
    )
    loss_ax.set_ylabel("loss of the true continuation (nats/token)")
    lines, labels = ax.get_legend_handles_labels()
    more_lines, more_labels = loss_ax.get_legend_handles_labels()
    ax.legend(lines + more_lines, labels + more_labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
