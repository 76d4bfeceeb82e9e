"""`tabrl evaluate` (one model's held-out metrics, or candidate vs champion with the gate), `tabrl acceptance`
and `tabrl headroom` (one model on held-out editor traffic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.console import ParamsOpt, RegionsOpt, SetOpt, console, fail, params_or_exit, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE

ModelOpt = Annotated[Path, typer.Option("--model", help="Model directory to evaluate (the candidate).")]
AgainstOpt = Annotated[Path | None, typer.Option("--against", help="Champion model directory to compare with.")]
TestOpt = Annotated[Path, typer.Option("--test", help="Held-out FIM samples.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write metrics (and the gate) here.")]


def _fmt(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() and abs(value) >= 1 else f"{value:.4f}"


def _metrics_table(results: list, model: Path, against: Path | None, metrics: tuple[str, ...]) -> Table:
    """The metrics of the candidate (and, against a champion, the champion's and the delta), one row each."""
    n = len(results[0].rows)
    typed_requests = int(results[0].metrics["eval/typing/requests"])
    table = Table(
        title=f"Held-out evaluation: {typed_requests} typing requests, {n} FIM samples, judge {results[0].judge}"
    )
    table.add_column("metric")
    table.add_column(f"candidate\n{model}", justify="right")
    if against is not None:
        table.add_column(f"champion\n{against}", justify="right")
        table.add_column("delta", justify="right")
    for name in metrics:
        values = [r.metrics[name] for r in results]
        cells = [_fmt(v) for v in values]
        if against is not None:
            cells.append(f"{values[0] - values[1]:+.4f}")
        table.add_row(name, *cells)
    return table


def evaluate_cmd(
    model: ModelOpt,
    against: AgainstOpt = None,
    test: TestOpt = Path("data/fim/test.parquet"),
    regions: RegionsOpt = Path("data/fim/typing_test.parquet"),
    json_out: JsonOpt = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Score a model on held-out editor traffic (simulated users typing test files) and FIM samples
    (judge, reference metrics); with --against, compare it with the champion and print the gate decision."""
    from tasks.core.generate import ModelLoadError, check_model_dir
    from tasks.evaluate.evaluate import METRICS, compare, evaluate_model
    from tasks.evaluate.judge import JudgeError
    from tasks.sim.corpus import CorpusError, read_samples
    from tasks.sim.editor import read_regions

    p = params_or_exit(params, set_)
    try:
        for path in (model, against):  # the models first: the likeliest mistake, named before any data is read
            if path is not None:
                check_model_dir(path)
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
    print_table(_metrics_table(results, model, against, METRICS))
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


def acceptance_cmd(
    model: Annotated[Path | None, typer.Option(help="Model directory (default: model.base_dir).")] = None,
    regions: RegionsOpt = Path("data/fim/typing_test.parquet"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the numbers here.")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Held-out simulated acceptance of a model: simulated users type held-out files (greedy; in process, or on
    vLLM with serving.backend=vllm; a LoRA adapter version runs on the base it records).

    Prints suggestion rate, accept/shown (persona noise included), right/shown without noise, and
    characters saved, each with a 95 % bootstrap interval over typing sessions."""
    from tasks.core.adapters import AdapterBaseError
    from tasks.core.generate import ModelLoadError, check_model_dir, describe_rule, show_rule
    from tasks.core.intervals import interval, metric_fns
    from tasks.core.vllm import VllmError
    from tasks.sim.acceptance import noise_floor, typing_acceptance
    from tasks.sim.editor import read_regions

    p = params_or_exit(params, set_)
    console.print(describe_rule(show_rule(p.serving)), highlight=False)
    try:
        run = typing_acceptance(check_model_dir(model or p.model.base_dir), read_regions(regions), p)
    except (FileNotFoundError, ModelLoadError, AdapterBaseError, VllmError) as err:
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
    """What a checkpoint could earn: right rate greedy and at the serving temperature, pass@k, noise floor, and the
    loss of the true continuation."""
    from tasks.core.generate import ModelLoadError, check_model_dir
    from tasks.sim.acceptance import headroom
    from tasks.sim.editor import read_regions

    p = params_or_exit(params, set_)
    try:
        h = headroom(
            check_model_dir(model or p.model.base_dir),
            read_regions(regions),
            p,
            requests,
            k=k,
            min_accept_chars=min_chars,
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
        ("right per request had greedy stopped at its best point", h.greedy_right_if_cut),
        (f"right per request, sampled at T={h.temperature}", h.sampled_right),
        (f"right in at least one of {h.k} samples (pass@{h.k})", h.pass_at_k),
        ("noise floor (accept/shown of a never-right model)", h.noise_floor),
        ("loss of the true continuation (nats per token)", h.middle_loss),
    ):
        table.add_row(label, f"{value:.4f}")
    print_table(table)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(h.as_dict(), indent=2) + "\n")
