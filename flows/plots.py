"""Curves across cycles: online acceptance (users over HTTP) and held-out evaluation, one PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless; set at import because pyplot is imported right below
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402

from tasks.core import vocab
from tasks.core.config import Params  # noqa: E402
from tasks.deploy.tracking import CycleRuns  # noqa: E402


def plot_cycles(rows: Sequence, path: Path, params: Params | None = None) -> Path:
    """Plot suggestion rate, accept rate and reward per request per cycle; given `params`, log the PNG and
    the online metrics per cycle to a run `online loop · N cycles` beside the cycle runs."""
    cycles = [r.cycle for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    online = axes[0]
    online.plot(cycles, [r.suggest_rate for r in rows], "o-", label="suggestion rate")
    online.plot(cycles, [r.accept_rate for r in rows], "o-", label="accept rate / shown")
    online.plot(cycles, [r.right_rate for r in rows], "o--", label="right / shown (no noise)")
    online.plot(cycles, [r.chars_saved for r in rows], "o-", label="characters saved")
    online.plot(cycles, [r.reward_per_request for r in rows], "o-", label="reward / request")
    online.set_title("online (simulated users typing over HTTP, traffic before each cycle)")
    held = axes[1]
    for key, label in (
        ("eval_accept_rate", "candidate accept / shown"),
        ("eval_chars_saved", "candidate characters saved"),
        ("eval_reward_per_request", "candidate reward / request"),
        ("champion_eval_reward_per_request", "champion reward / request"),
    ):
        points = [(r.cycle, getattr(r, key)) for r in rows if getattr(r, key) is not None]
        if points:
            held.plot(*zip(*points, strict=True), "o-", label=label)
    held.set_title("held-out editor traffic (each cycle's candidate vs champion)")
    for ax in axes:
        ax.set_xlabel("cycle")
        ax.set_xticks(cycles)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    if params is not None:
        exp = CycleRuns(params).experiment_id()
        mlflow.set_tracking_uri(params.paths.mlflow_tracking_uri)
        name = f"online loop · {len(rows)} cycles"
        with mlflow.start_run(experiment_id=exp, run_name=name, tags={vocab.KIND: "loop_summary"}):
            mlflow.log_artifact(str(path))
            for r in rows:
                mlflow.log_metrics(
                    {
                        "online/suggest_rate": r.suggest_rate,
                        "online/accept_rate": r.accept_rate,
                        "online/right_rate": r.right_rate,
                        "online/chars_saved": r.chars_saved,
                        "online/reward_per_request": r.reward_per_request,
                    },
                    step=r.cycle,
                )
    return path
