"""The pieces every `tabrl` command shares: the console, tables, errors, and the params options.

A leaf: it imports no command module, and every command module imports it (``flows/cli/main.py``, the
root app, imports the command modules), so the CLI has no import circle.

Output that a person or a script reads must not depend on the terminal's width: text is printed
without soft wrapping (a long path or snapshot name stays on one line, greppable whole), and a
table is rendered at its own natural width instead of being squeezed (cells cut with "…") to fit
a narrow terminal. Tables here are a few short columns, so they fit 80 columns as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from tasks.core.config import Params, ParamsError, load_params

console = Console(soft_wrap=True)


def print_table(table: Table) -> None:
    """Print a table at its natural width (title included), whatever the terminal's width."""
    wide = console.options.update(width=10_000, max_width=10_000)
    width = Measurement.get(console, wide, table).maximum
    title = len(str(table.title)) if table.title else 0
    table.width = max(width, title)  # the table's own width wins over the terminal's
    console.print(table, crop=False)


ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override one key: section.key=value (repeatable).")]
CorpusOpt = Annotated[Path, typer.Option(help="Corpus table written by `tabrl corpus`.")]
RegionsOpt = Annotated[
    Path, typer.Option("--regions", help="Held-out regions simulated users type (the `fim` stage writes them).")
]


OutputOpt = Annotated[
    Literal["table", "json"],
    typer.Option("--output", "-o", help="`table` for a person, `json` for a script (one document on stdout)."),
]


def print_json(document: object) -> None:
    """One JSON document on stdout, as plain text (no colours, no wrapping): what `--output json` prints."""
    typer.echo(json.dumps(document, indent=2, sort_keys=True))


def fail(message: str, code: int = 1) -> NoReturn:
    """Exit with a one-sentence error on stderr (never wrapped, so it can be grepped)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def params_or_exit(path: Path, overrides: list[str] | None) -> Params:
    """Load params or exit 2 with the validation message."""
    try:
        return load_params(path, overrides or [])
    except ParamsError as err:
        fail(str(err), 2)
