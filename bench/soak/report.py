"""The soak's table, its faults and the plot of acceptance over wall-clock time."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from bench.soak.reconcile import MUST_BE_ZERO
from bench.soak.stack import Soak
from bench.soak.traffic import Ledger
from flows.cli.console import print_table
from tasks.core.config import load_params


def plot(path: Path, soak: Soak, ledger: Ledger, bin_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    t0 = soak.started
    bins: dict[int, list[float]] = {}  # bin -> [shown, accepted, accepted chars]
    for cid, c in ledger.completions.items():
        f = ledger.feedback.get(cid)
        if not c["shown"] or (f is not None and f["shown"] is False):
            continue
        b = bins.setdefault(int((c["t"] - t0) // bin_s), [0.0, 0.0, 0.0])
        b[0] += 1
        if f is not None and f["accepted"]:
            b[1] += 1
            b[2] += f["accepted_chars"] or 0
    keys = sorted(bins)
    x = [(k + 0.5) * bin_s / 60 for k in keys]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    top.plot(x, [bins[k][1] / bins[k][0] for k in keys], "o-", ms=3, label="accept / shown")
    bottom.plot(x, [bins[k][2] / bins[k][0] for k in keys], "o-", ms=3, color="tab:purple",
                label="accepted characters / shown")  # fmt: skip
    colours = {"promoted": "tab:green", "rolled back": "tab:orange", "challenger": "tab:blue", "fault": "tab:red"}
    for e in soak.events:
        if e["kind"] not in colours or not e.get("injected", True):
            continue
        x = (e.get("at", e["t"]) - t0) / 60  # a fault at its injection, not at its recovery
        for ax in (top, bottom):
            ax.axvline(x, color=colours[e["kind"]], lw=1, alpha=0.7, ls="--" if e["kind"] == "fault" else "-")
        if e["kind"] == "fault":
            top.annotate(e["fault"], (x, 0.98), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="top",
                         color="tab:red")  # fmt: skip
    top.set_ylabel("accept / shown")
    bottom.set_ylabel("accepted chars / shown")
    bottom.set_xlabel("minutes into the soak")
    handles = [plt.Line2D([], [], color=c, ls="--" if k == "fault" else "-", label=k) for k, c in colours.items()]
    top.legend(handles=[*top.get_lines()[:1], *handles], fontsize=8, loc="lower right")
    top.set_title(f"soak: {len(ledger.completions)} answered completions, {bin_s / 60:.0f}-min bins")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine(params_file: Path) -> dict:
    from tasks.core.machine import describe

    return describe(load_params(params_file, [])).as_dict()


def print_report(report: dict, soak: Soak) -> None:
    m = report["machine"]
    bf16 = ", ".join(m["bf16_units"]) or "no bf16 units"
    where = f"{m['cpu']}, {m['cores']} cores, {m['isa']}, {bf16}, train dtype {m['train_dtype']}"
    table = Table(title=f"soak: {report['seconds'] / 60:.0f} min of traffic ({where})")
    table.add_column("count")
    table.add_column("value", justify="right")
    table.add_column("must be 0")
    for key, value in report["table"].items():
        table.add_row(key, str(value), "yes" if key in MUST_BE_ZERO else "")
    print_table(table)
    faults = Table(title="faults and recovery")
    for col in ("min", "fault", "what", "recovery s"):
        faults.add_column(col)
    for f in report["faults"]:
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"
        faults.add_row(f"{soak.minutes(f.get('at', f['t'])):.1f}", f["fault"], f["what"], rec)
    print_table(faults)
