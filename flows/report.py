"""What an online loop and the demo print at the end: the per-cycle table and plot, the closing story (base vs
final champion on held-out requests no gate typed, with intervals and, in words, what the intervals say) and where
to look next (the MLflow and Prefect UIs)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.config import Params

if TYPE_CHECKING:
    from flows.loop_state import CycleRow

STORY_METRICS = ("suggest_rate", "accept_rate", "right_rate", "chars_saved", "reward_per_request")
STORY_NAMES = {
    "suggest_rate": "suggestions shown per request",
    "accept_rate": "accept/shown",
    "right_rate": "right/shown",
    "chars_saved": "characters saved",
    "reward_per_request": "reward per request",
}


def print_report(rows: list[CycleRow], state: Path, params: Params, promoted_on_gate: bool = False) -> None:
    """One row per cycle, the plot of the curves, both saved in `state`. promoted_on_gate: the loop trusted the
    gate (no A/B test between cycles), which the table's title says."""
    from rich.table import Table

    from flows.cli.console import console, print_table
    from flows.plots import plot_cycles

    how = "promoted on the gate" if promoted_on_gate else "A/B decisions between cycles"
    table = Table(
        title=f"tabrl online RL cycles, {how} (online = simulated users typing train files over HTTP; "
        "eval = held-out test files)"
    )
    columns = ("cycle", "arms (requests)", "online suggest", "online accept/shown", "online right/shown")
    columns += ("online chars saved", "A/B decision", "cycle", "eval judge", "eval accept/shown", "eval chars saved")
    for col in (*columns, "eval reward/req (champion)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.cycle),
            r.arms_served,
            _fmt(r.suggest_rate),
            _fmt(r.accept_rate),
            _fmt(r.right_rate),
            _fmt(r.chars_saved),
            r.decision,
            r.cycle_status,
            _fmt(r.eval_judge_mean),
            _fmt(r.eval_accept_rate),
            _fmt(r.eval_chars_saved),
            f"{_fmt(r.eval_reward_per_request)} ({_fmt(r.champion_eval_reward_per_request)})",
        )
    print_table(table)
    plot = plot_cycles(rows, state / "cycles.png", params)
    (state / "cycles.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    console.print(f"Plot: {plot}   Table: {state / 'cycles.json'}")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_story(base_dir: Path, final_dir: Path, state: Path, params: Params, final: str = "final champion") -> dict:
    """The base vs the final champion (or another model, named by `final`) on held-out editor traffic, with 95 %
    intervals: what a user feels. Typed through held-out regions no gate evaluation reached: the gate chose the
    champion on the others."""
    from rich.table import Table

    from flows.cli.console import console, print_table
    from tasks.core.intervals import difference, interval, metric_fns
    from tasks.sim.acceptance import noise_floor, typing_acceptance, unseen_regions
    from tasks.sim.editor import read_regions, regions_path

    regions = unseen_regions(read_regions(regions_path(params.paths.data_dir, "test")))
    runs = {"base": typing_acceptance(base_dir, regions, params)}
    same = final_dir.resolve() == base_dir.resolve()
    runs["final"] = runs["base"] if same else typing_acceptance(final_dir, regions, params)
    fns = metric_fns(params.reward)
    table = Table(
        title=f"Held-out editor traffic the gate never typed, base vs {final} ({params.evaluate.n_requests} "
        "requests each, 95 % bootstrap intervals over typing sessions; the change paired: the same regions, users "
        "and noise draws)"
    )
    for col in ("metric", "base", final, "change", "change excludes 0"):
        table.add_column(col, justify="right")
    story = {}
    for name in STORY_METRICS:
        a, b = interval([runs["base"].sessions], fns[name]), interval([runs["final"].sessions], fns[name])
        d = difference([runs["final"].sessions], [runs["base"].sessions], fns[name], paired=True)
        story[name] = {"base": [a.value, a.low, a.high], "final": [b.value, b.low, b.high]}
        story[name]["change"] = [d.value, d.low, d.high]
        change = f"{d.value:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"
        table.add_row(name, str(a), str(b), change, "yes" if d.excludes_zero else "no")
    print_table(table)
    console.print(
        f"{final}: {final_dir}; noise floor of accept/shown (never-right model): {noise_floor(params.simulator):.4f}",
        highlight=False,
    )
    for line in story_in_words(story, same):
        console.print(line, highlight=False)
    (state / "story.json").write_text(json.dumps(story, indent=2) + "\n")
    return story


def story_in_words(story: dict, same_model: bool = False) -> list[str]:
    """The closing table in sentences: each change is called a gain or a loss only where its interval excludes 0;
    otherwise the sentence says the interval includes 0 (this run cannot tell the two models apart there)."""
    if same_model:
        return ["The final champion is the base: no candidate was promoted, so there is no change to report."]
    lines = []
    for name in STORY_METRICS:
        value, low, high = story[name]["change"]
        what = STORY_NAMES[name]
        if low > 0:
            lines.append(f"{what}: up {value:+.4f}; the 95 % interval [{low:+.4f}, {high:+.4f}] excludes 0.")
        elif high < 0:
            lines.append(f"{what}: down {value:+.4f}; the 95 % interval [{low:+.4f}, {high:+.4f}] excludes 0.")
        else:
            lines.append(
                f"{what}: {value:+.4f}, but the 95 % interval [{low:+.4f}, {high:+.4f}] includes 0: "
                "no change can be claimed."
            )
    return lines


def print_ui_pointers(params: Params) -> None:
    """How to open what the run recorded: MLflow's runs (named for their outcome) and the Prefect UI."""
    from flows.cli.console import console
    from tasks.deploy.tracking import CycleRuns

    console.print(
        f"MLflow UI:  mlflow ui --backend-store-uri {params.paths.mlflow_tracking_uri} --workers 1, then "
        f"{CycleRuns(params).runs_view_url('http://127.0.0.1:5000')} (the cycles' runs, named for their outcome)"
    )
    console.print(
        "Prefect UI: prefect server start --host 127.0.0.1, then `tabrl schedule` (http://127.0.0.1:4200); "
        "this run used Prefect's ephemeral mode"
    )


def print_ab(ab: dict) -> None:
    """The demo's live A/B test (flows/demo.py): its plan, each arm's numbers and the decision."""
    from rich.table import Table

    from flows.cli.console import console, print_table
    from tasks.core.store import CHALLENGER, CHAMPION

    n = ab["numbers"]
    plan = ab["plan"]
    table = Table(
        title=f"Live A/B test, looked at once: base (champion) vs final model (challenger); planned "
        f"{plan['per_arm']} requests per arm (power {plan['power']:.0%} for a reward difference of "
        f"{plan['mde']} at alpha {plan['alpha']}, reward sd {plan['reward_sd']:.3f}"
        + (
            f"; {plan['needed']} asked for, capped to fit the time: power {plan['power_at_n']:.0%}"
            if plan["needed"] > plan["per_arm"]
            else ""
        )
        + ")"
        + (
            f"; run to {ab['ran_to']} with what the time budget left (power "
            + ", ".join(f"{p:.0%} at {mde:.4f}" for mde, p in ab["ran_to_power"])
            + ")"
            if ab.get("ran_to", 0) > plan["per_arm"]
            else ""
        )
    )
    for col in ("arm", "requests", "shown", "accept/shown", "reward/request", "accepted chars/request"):
        table.add_column(col, justify="right")
    for arm in (CHAMPION, CHALLENGER):
        if f"{arm}_requests" in n:
            table.add_row(
                arm,
                f"{n[f'{arm}_requests']:.0f}",
                f"{n[f'{arm}_shown']:.0f}",
                f"{n[f'{arm}_accept_rate']:.3f}",
                f"{n[f'{arm}_reward_per_request']:.4f}",
                f"{n[f'{arm}_chars_per_request']:.2f}",
            )
    print_table(table)
    verdict = "PROMOTED on live A/B evidence" if ab["action"] == "promote" else "ROLLED BACK"
    console.print(f"{verdict}: {ab['reason']}", highlight=False)
