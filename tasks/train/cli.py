"""`tabrl train`: one PPO (or offline GRPO) update of a checkpoint, on CPU or GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from tasks.config import DEFAULT_PARAMS_FILE


def train_cmd(
    from_dir: Annotated[Path, typer.Option("--from", help="Starting checkpoint (HF directory).")],
    out: Annotated[Path, typer.Option(help="Directory for the trained checkpoint (written atomically).")],
    snapshot: Annotated[Path | None, typer.Option(help="Reward-labelled snapshot Parquet (algorithm ppo).")] = None,
    algorithm: Annotated[str | None, typer.Option(help="ppo | grpo (default: train.algorithm).")] = None,
    fim: Annotated[Path, typer.Option(help="FIM train samples (algorithm grpo).")] = Path("data/fim/train.parquet"),
    params: Annotated[Path, typer.Option("--params", help="params.yaml to read.")] = DEFAULT_PARAMS_FILE,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override one key: section.key=value (repeatable).")
    ] = None,
) -> None:
    """Critic-free PPO on a rewarded snapshot (or offline GRPO on FIM prompts) -> an HF checkpoint."""
    from tasks.cli import console, fail, params_or_exit
    from tasks.generate import ModelLoadError
    from tasks.ingest.corpus import CorpusError, read_samples
    from tasks.train.grpo import grpo_snapshot
    from tasks.train.launch import TrainError, launch_train
    from tasks.train.ppo import SnapshotError, TrainingDiverged

    overrides = list(set_ or []) + ([f"train.algorithm={algorithm}"] if algorithm else [])
    p = params_or_exit(params, overrides)
    algo: Literal["ppo", "grpo"] = p.train.algorithm
    try:
        if algo == "grpo":
            snapshot = out.with_name(out.name + ".grpo.parquet")
            stats = grpo_snapshot(from_dir, read_samples(fim), p, snapshot)
            console.print(f"GRPO snapshot {snapshot}: {stats}")
        elif snapshot is None:
            fail("--snapshot PATH is required for algorithm ppo (or pass --algorithm grpo --fim PATH)", 2)
        result = launch_train(snapshot, from_dir, out, p)
    except (SnapshotError, CorpusError, ModelLoadError) as err:
        fail(str(err), 2)
    except (TrainingDiverged, TrainError) as err:
        fail(f"{type(err).__name__}: {err}", 1)
    console.print(
        f"Saved {result.out_dir}: {result.steps} steps on {result.rows_used}/{result.rows} rows, "
        f"{result.tokens_per_s:.0f} tokens/s ({result.engine}, {result.world_size} rank(s)); final {result.final}"
    )
