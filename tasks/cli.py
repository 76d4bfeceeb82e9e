"""`tabrl`: the command line of the pipeline and the gateway.

Every command reads params.yaml (``--params``) and takes ``--set section.key=value`` overrides;
``TABRL_SECTION__KEY`` environment variables override too. Run ``tabrl COMMAND --help``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tasks.config import DEFAULT_PARAMS_FILE, Params, ParamsError, load_params

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
console = Console()

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override one key: section.key=value (repeatable).")]


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
    """Draw FIM samples the way an editor cursor meets code: rest of line, a line, a few lines."""
    from tasks.ingest.corpus import CorpusError, read_corpus, write_fim

    p = params_or_exit(params, set_)
    try:
        stats = write_fim(p.data, p.fim, read_corpus(corpus), out)
    except CorpusError as err:
        fail(str(err), 2)
    console.print(f"Wrote {out}/train.parquet and {out}/test.parquet: {stats}")


@app.command("build-base")
def build_base_cmd(
    corpus: CorpusOpt = Path("data/corpus/files.parquet"),
    out: Annotated[Optional[Path], typer.Option(help="Checkpoint directory (default: model.base_dir).")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Build tabrl-tiny: BPE tokenizer + small Qwen2, FIM pre-trained on the train files."""
    from tasks.ingest.corpus import CorpusError, read_corpus
    from tasks.train.base import build_base

    p = params_or_exit(params, set_)
    target = out or Path(p.model.base_dir)
    try:
        train_files = read_corpus(corpus)["train"]
    except CorpusError as err:
        fail(str(err), 2)
    console.print(f"Building tabrl-tiny from {len(train_files)} train files into {target} ...")
    stats = build_base(train_files, p.model, p.fim, target)
    console.print(f"Saved {target}: {stats}")


@app.command("acceptance")
def acceptance_cmd(
    model: Annotated[Optional[Path], typer.Option(help="Model directory (default: model.base_dir).")] = None,
    test: Annotated[Path, typer.Option(help="Held-out FIM samples.")] = Path("data/fim/test.parquet"),
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the numbers here.")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Held-out simulated acceptance of a model (in process, greedy decoding)."""
    from tasks.acceptance import acceptance
    from tasks.generate import ModelLoadError
    from tasks.ingest.corpus import CorpusError, read_samples

    p = params_or_exit(params, set_)
    try:
        samples = read_samples(test)
        result = acceptance(model or Path(p.model.base_dir), samples, p)
    except (CorpusError, ModelLoadError) as err:
        fail(str(err), 2)
    s = result.summary
    table = Table(title=f"Held-out simulated acceptance: {model or p.model.base_dir}")
    for col in ("held-out samples", "suggestion rate", "accept / shown", "accept / request", "mean length (chars)"):
        table.add_column(col, justify="right")
    table.add_row(str(s.requests), f"{s.suggest_rate:.3f}", f"{s.accept_rate:.3f}", f"{s.accept_per_request:.3f}",
                  f"{s.mean_len:.1f}")
    console.print(table)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({
            "samples": s.requests, "suggest_rate": s.suggest_rate, "accept_rate": s.accept_rate,
            "accept_per_request": s.accept_per_request, "mean_len": s.mean_len}, indent=2) + "\n")


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
