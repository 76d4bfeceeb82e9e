"""`tabrl evaluate`: one model's held-out metrics, or candidate vs champion side by side with the gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tasks.config import DEFAULT_PARAMS_FILE

ModelOpt = Annotated[Path, typer.Option("--model", help="Model directory to evaluate (the candidate).")]
AgainstOpt = Annotated[Path | None, typer.Option("--against", help="Champion model directory to compare with.")]
TestOpt = Annotated[Path, typer.Option("--test", help="Held-out FIM samples.")]
RegionsOpt = Annotated[Path, typer.Option("--regions", help="Held-out regions simulated users type (editor traffic).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write metrics (and the gate) here.")]


def _fmt(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() and abs(value) >= 1 else f"{value:.4f}"


def evaluate_cmd(
    model: ModelOpt,
    against: AgainstOpt = None,
    test: TestOpt = Path("data/fim/test.parquet"),
    regions: RegionsOpt = Path("data/fim/typing_test.parquet"),
    json_out: JsonOpt = None,
    params: Annotated[Path, typer.Option("--params", help="params.yaml to read.")] = DEFAULT_PARAMS_FILE,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override one key: section.key=value.")] = None,
) -> None:
    """Score a model on held-out editor traffic (simulated users typing test files) and FIM samples
    (judge, reference metrics); with --against, compare it with the champion and print the gate decision."""
    from tasks.cli import console, fail, params_or_exit, print_table
    from tasks.editor import read_regions
    from tasks.evaluate.evaluate import METRICS, compare, evaluate_model
    from tasks.evaluate.judge import JudgeError
    from tasks.generate import ModelLoadError
    from tasks.ingest.corpus import CorpusError, read_samples

    p = params_or_exit(params, set_)
    try:
        samples, typed = read_samples(test), read_regions(regions)
        if against is None:
            results, comparison = [evaluate_model(model, samples, typed, p)], None
        else:
            comparison = compare(model, against, samples, typed, p)
            results = [comparison.candidate, comparison.champion]
    except (CorpusError, ModelLoadError, FileNotFoundError) as err:
        fail(str(err), 2)
    except JudgeError as err:
        fail(str(err), 1)
    n = len(results[0].rows)
    typed_requests = int(results[0].metrics["eval/typing/requests"])
    table = Table(
        title=f"Held-out evaluation: {typed_requests} typing requests, {n} FIM samples, judge {results[0].judge}"
    )
    table.add_column("metric")
    table.add_column(f"candidate\n{model}", justify="right")
    if comparison is not None:
        table.add_column(f"champion\n{against}", justify="right")
        table.add_column("delta", justify="right")
    for name in METRICS:
        values = [r.metrics[name] for r in results]
        cells = [_fmt(v) for v in values]
        if comparison is not None:
            cells.append(f"{values[0] - values[1]:+.4f}")
        table.add_row(name, *cells)
    print_table(table)
    payload: dict = {"candidate": results[0].metrics, "judge": results[0].judge}
    if comparison is not None:
        d = comparison.decision
        style = "bold green" if d.passed else "bold red"
        console.print(f"[{style}]gate: {'PASS' if d.passed else 'FAIL'}[/{style}]")
        for reason in d.reasons:
            console.print(f"  - {reason}", highlight=False)
        gate_json = {"passed": d.passed, "reasons": d.reasons, "numbers": d.numbers}
        payload.update(champion=results[1].metrics, gate=gate_json)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(payload, indent=2) + "\n")
