"""`tabrl corpus`, `tabrl data` (offline data preparation) and `tabrl ingest` (one ingest cycle)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.console import CorpusOpt, ParamsOpt, SetOpt, console, fail, params_or_exit, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE


def ingest_cmd(
    repo: Annotated[
        Path | None,
        typer.Option(
            help="The repo snapshots go in, under its data dir; DVC-versioned if it is a DVC repo "
            "(default: paths.snapshots_repo, a git + DVC repo made on first use)."
        ),
    ] = None,
    now: Annotated[float | None, typer.Option(help="Decide outcomes as of this unix time (default: now).")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Pull the log store since the watermark, clean, write a DVC-versioned Parquet snapshot, advance the watermark."""
    from tasks.core.store import open_store
    from tasks.ingest.snapshot import IngestError, run_ingest
    from tasks.ingest.versioning import ensure_repo

    p = params_or_exit(params, set_)
    with open_store(p.paths.database_url) as engine:
        try:
            snapshots = repo if repo is not None else ensure_repo(Path(p.paths.snapshots_repo))
            result = run_ingest(engine, p, snapshots, time.time() if now is None else now)
        except (IngestError, ValueError) as err:
            fail(str(err), 2)
    table = Table(title=f"Cleaning report (completions seq {result.first_seq}..{result.last_seq})")
    table.add_column("rule")
    table.add_column("rows", justify="right")
    for rule, count in result.report.items():
        table.add_row(rule, str(count))
    print_table(table)
    for arm, s in result.arms.items():
        console.print(
            f"{arm}: {s.requests} requests, suggestion rate {s.suggest_rate:.3f}, accept rate {s.accept_rate:.3f}",
            highlight=False,
        )
    console.print(
        f"late feedback recorded: {result.late_feedback}; left for later cycles: {result.pending}", highlight=False
    )
    if result.snapshot is None:
        console.print(
            f"no snapshot: {result.rows} clean rows < ingest.min_rows={p.ingest.min_rows}; "
            f"watermark stays at {result.watermark}",
            highlight=False,
        )
        return
    console.print(f"snapshot: {result.snapshot} ({result.rows} rows, sha256 {result.sha256})", highlight=False)
    console.print(f"dvc: {result.dvc}; watermark: {result.watermark}", highlight=False)


def corpus_cmd(
    out: Annotated[Path, typer.Option(help="Directory for files.parquet.")] = Path("data/corpus"),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Collect the code corpus (stdlib, a directory or a FIM data set) and split it train/test by file."""
    from tasks.sim.corpus import CorpusError, resolve_source, write_corpus

    p = params_or_exit(params, set_)
    console.print(f"Reading code from {resolve_source(p.data)} ...")
    try:
        stats = write_corpus(p.data, out)
    except CorpusError as err:
        fail(str(err), 2)
    console.print(f"Wrote {out}/files.parquet: {stats}")


def data_cmd(
    corpus: CorpusOpt = Path("data/corpus/files.parquet"),
    out: Annotated[Path, typer.Option(help="Directory for train.parquet and test.parquet.")] = Path("data/fim"),
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """FIM spans (rest of line, a line, a few lines) and the regions simulated users type (editor traffic)."""
    from tasks.sim.corpus import CorpusError, read_corpus, write_fim

    p = params_or_exit(params, set_)
    try:
        stats = write_fim(p.data, p.fim, p.traffic, read_corpus(corpus), out)
    except CorpusError as err:
        fail(str(err), 2)
    console.print(
        f"Wrote {out}/train.parquet, test.parquet (FIM spans) and typing_train.parquet, "
        f"typing_test.parquet (editor-traffic regions): {stats}"
    )
