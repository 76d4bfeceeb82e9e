"""`tabrl`: the command line of the pipeline and the gateway.

Every command reads params.yaml (``--params``) and takes ``--set section.key=value`` overrides;
``TABRL_SECTION__KEY`` environment variables override too. Run ``tabrl COMMAND --help``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tasks.config import DEFAULT_PARAMS_FILE, Params, ParamsError, load_params
from tasks.console import console, print_table

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override one key: section.key=value (repeatable).")]


def params_or_exit(path: Path, overrides: list[str] | None) -> Params:
    """Load params or exit 2 with the validation message."""
    try:
        return load_params(path, overrides or [])
    except ParamsError as err:
        fail(str(err), 2)


def fail(message: str, code: int = 1) -> None:
    """Exit with a one-sentence error on stderr (never wrapped, so it can be grepped)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command("params")
def show_params(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Print the resolved config (file + env + --set) as YAML-like dotted keys."""
    resolved = params_or_exit(params, set_)
    for key, value in resolved.flat().items():
        console.print(f"{key} = {json.dumps(value)}", highlight=False)


CorpusOpt = Annotated[Path, typer.Option(help="Corpus table written by `tabrl corpus`.")]


@app.command("corpus")
def corpus_cmd(
    out: Annotated[Path, typer.Option(help="Directory for files.parquet.")] = Path("data/corpus"),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Collect the code corpus (stdlib, a directory or a FIM data set) and split it train/test by file."""
    from tasks.ingest.corpus import CorpusError, resolve_source, write_corpus

    p = params_or_exit(params, set_)
    console.print(f"Reading code from {resolve_source(p.data)} ...")
    try:
        stats = write_corpus(p.data, out)
    except CorpusError as err:
        fail(str(err), 2)
    console.print(f"Wrote {out}/files.parquet: {stats}")


@app.command("data")
def data_cmd(
    corpus: CorpusOpt = Path("data/corpus/files.parquet"),
    out: Annotated[Path, typer.Option(help="Directory for train.parquet and test.parquet.")] = Path("data/fim"),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """FIM spans (rest of line, a line, a few lines) and the regions simulated users type (editor traffic)."""
    from tasks.ingest.corpus import CorpusError, read_corpus, write_fim

    p = params_or_exit(params, set_)
    try:
        stats = write_fim(p.data, p.fim, p.traffic, read_corpus(corpus), out)
    except CorpusError as err:
        fail(str(err), 2)
    console.print(
        f"Wrote {out}/train.parquet, test.parquet (FIM spans) and typing_train.parquet, "
        f"typing_test.parquet (editor-traffic regions): {stats}"
    )


@app.command("build-base")
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
    from tasks.ingest.corpus import CorpusError, read_corpus
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


RegionsOpt = Annotated[
    Path, typer.Option("--regions", help="Held-out regions simulated users type (the `fim` stage writes them).")
]


@app.command("acceptance")
def acceptance_cmd(
    model: Annotated[Path | None, typer.Option(help="Model directory (default: model.base_dir).")] = None,
    regions: RegionsOpt = Path("data/fim/typing_test.parquet"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the numbers here.")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Held-out simulated acceptance of a model: simulated users type held-out files (greedy, in process).

    Prints suggestion rate, accept/shown (persona noise included), right/shown without noise, and
    characters saved, each with a 95 % bootstrap interval over typing sessions."""
    from tasks.acceptance import noise_floor, typing_acceptance
    from tasks.editor import read_regions
    from tasks.generate import ModelLoadError
    from tasks.intervals import interval, metric_fns

    p = params_or_exit(params, set_)
    try:
        run = typing_acceptance(model or Path(p.model.base_dir), read_regions(regions), p)
    except (FileNotFoundError, ModelLoadError) as err:
        fail(str(err), 2)
    fns = metric_fns(p.reward)
    names = ("suggest_rate", "accept_rate", "right_rate", "chars_saved", "reward_per_request")
    cis = {name: interval([run.sessions], fns[name]) for name in names}
    table = Table(
        title=f"Held-out editor traffic: {model or p.model.base_dir} "
        f"({run.summary.requests} requests, {len(run.sessions)} typing sessions)"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("95 % interval", justify="right")
    for name, ci in cis.items():
        table.add_row(name, f"{ci.value:.4f}", f"[{ci.low:.4f}, {ci.high:.4f}]")
    print_table(table)
    floor = noise_floor(p.simulator)
    console.print(
        f"noise floor: a never-right model gets accept/shown {floor:.4f} from persona noise alone", highlight=False
    )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps(
                {
                    **run.summary.as_dict(),
                    "noise_floor": floor,
                    "sessions": len(run.sessions),
                    "intervals": {k: [v.low, v.high] for k, v in cis.items()},
                },
                indent=2,
            )
            + "\n"
        )


@app.command("headroom")
def headroom_cmd(
    model: Annotated[Path | None, typer.Option(help="Model directory (default: model.base_dir).")] = None,
    regions: RegionsOpt = Path("data/fim/typing_test.parquet"),
    requests: Annotated[
        int, typer.Option(help="Held-out requests (every pause of the regions, no Tab taken).", min=1)
    ] = 300,
    k: Annotated[int, typer.Option(help="Samples per request for pass@k.", min=1)] = 8,
    min_chars: Annotated[
        int, typer.Option(help="K of the noise-free rule: non-blank characters a right suggestion covers.", min=1)
    ] = 4,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the numbers here.")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """What a checkpoint could earn: right rate greedy and at the serving temperature, pass@k, noise floor."""
    from tasks.acceptance import headroom
    from tasks.editor import read_regions
    from tasks.generate import ModelLoadError

    p = params_or_exit(params, set_)
    try:
        h = headroom(
            model or Path(p.model.base_dir), read_regions(regions), p, requests, k=k, min_accept_chars=min_chars
        )
    except (FileNotFoundError, ModelLoadError, ValueError) as err:
        fail(str(err), 2)
    table = Table(
        title=f"Headroom on held-out editor traffic: {model or p.model.base_dir} "
        f"({h.requests} requests, K={h.min_accept_chars})"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    for label, value in (
        ("suggestion rate (greedy)", h.greedy_shown),
        ("right per request, greedy (pass@1)", h.greedy_right),
        ("right per shown suggestion, greedy", h.greedy_right_per_shown),
        (f"right per request, sampled at T={h.temperature}", h.sampled_right),
        (f"right in at least one of {h.k} samples (pass@{h.k})", h.pass_at_k),
        ("noise floor (accept/shown of a never-right model)", h.noise_floor),
    ):
        table.add_row(label, f"{value:.4f}")
    print_table(table)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(h.as_dict(), indent=2) + "\n")


from tasks.evaluate.cli import evaluate_cmd  # noqa: E402  (after the shared helpers it imports lazily)

app.command("evaluate")(evaluate_cmd)

from tasks.deploy.cli import ab_status_cmd, promote_cmd, rollback_cmd  # noqa: E402

app.command("promote")(promote_cmd)
app.command("rollback")(rollback_cmd)
app.command("ab-status")(ab_status_cmd)

from serving.cli import arms_cmd, import_continue_cmd, keys_app, serve_cmd, simulate_cmd  # noqa: E402

app.command("serve")(serve_cmd)
app.command("arms")(arms_cmd)
app.command("import-continue")(import_continue_cmd)
app.command("simulate")(simulate_cmd)
app.add_typer(keys_app, name="keys")


from tasks.train.cli import train_cmd  # noqa: E402

app.command("train")(train_cmd)

from tasks.ingest.cli import ingest_cmd  # noqa: E402  (needs the helpers above)

app.command("ingest")(ingest_cmd)

from flows.cli import cycle_cmd, schedule_cmd  # noqa: E402

app.command("cycle")(cycle_cmd)
app.command("schedule")(schedule_cmd)

from serving.cli import purge_cmd  # noqa: E402

app.command("purge")(purge_cmd)
