"""`tabrl ingest`: one ingest cycle from the command line (registered in tasks/cli.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tasks.config import DEFAULT_PARAMS_FILE

# The same options as tasks/cli.py's ParamsOpt/SetOpt; importing them from there at import time
# would be circular when tasks/cli.py runs as `python -m tasks.cli`.
ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override one key: section.key=value (repeatable).")]


def ingest_cmd(
    repo: Annotated[
        Path, typer.Option(help="Project repo: snapshots go under its data dir; DVC-versioned if it is a DVC repo.")
    ] = Path("."),
    now: Annotated[float | None, typer.Option(help="Decide outcomes as of this unix time (default: now).")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Pull the log store since the watermark, clean, write a DVC-versioned Parquet snapshot, advance the watermark."""
    from serving.store import init_schema, make_engine
    from tasks.cli import console, fail, params_or_exit, print_table
    from tasks.ingest.snapshot import IngestError, run_ingest

    p = params_or_exit(params, set_)
    engine = make_engine(p.paths.database_url)
    try:
        init_schema(engine)
        result = run_ingest(engine, p, repo, time.time() if now is None else now)
    except (IngestError, ValueError) as err:
        fail(str(err), 2)
    finally:
        engine.dispose()
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
