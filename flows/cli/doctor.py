"""`tabrl doctor`: what this machine is, as every figure in docs/results.md names it, and what that means here;
with --predict, how long `make demo` or one online cycle will take here, from one short cycle timed on it."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flows.cli.console import ParamsOpt, SetOpt, console, fail, params_or_exit, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE, Params
from tasks.core.machine import Machine, VllmEnv, describe, vllm_env

if TYPE_CHECKING:  # the probe's imports (Prefect, the gateway) wait for --predict
    from flows.demo_plan import Probe


class Predict(StrEnum):
    demo = "demo"
    cycle = "cycle"


def doctor_cmd(
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
    no_vllm: Annotated[bool, typer.Option("--no-vllm", help="Skip importing vLLM (10-30 s on 2 cores).")] = False,
    predict: Annotated[
        Predict | None,
        typer.Option(
            "--predict",
            help="Also predict a wall time here from one short online cycle timed on this machine (80-100 s with "
            "tabrl-tiny on 2 cores; about 8 min with SmolLM2 on vLLM on a slow one): `demo`, what `make demo` will "
            "take and do; `cycle`, one online cycle of --requests with these params (e.g. --set "
            "@params.real-model.yaml --set @params.vllm-cpu.yaml).",
        ),
    ] = None,
    requests: Annotated[
        int, typer.Option(min=1, help="--predict cycle: the simulated requests of the cycle to predict.")
    ] = 500,
    users: Annotated[int, typer.Option(min=1, help="--predict cycle: its simulated users.")] = 16,
    probe_requests: Annotated[
        int, typer.Option(min=20, help="Requests of the timed cycle (and of its gate, per model).")
    ] = 200,
) -> None:
    """Print this machine's CPU, cores and CPU quota, the instruction set PyTorch's kernels use (AVX-512 or
    AVX2), whether it multiplies bf16 in hardware, the dtypes `host` and this config resolve to, and the vLLM
    that serving.vllm_python imports (its version). Quote it beside any figure you measure here. With --predict,
    how long `make demo` (and what it will run) or one online cycle will take here."""
    resolved = params_or_exit(params, set_)
    machine = describe(resolved)
    vllm = None if no_vllm else vllm_env(resolved)
    prediction = None
    if predict is not None:
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            try:
                prediction = _predict(predict, str(params), list(set_ or []), requests, users, probe_requests)
            except FileNotFoundError as missing:  # a fresh clone before `make data`: the regions it types
                fail(f"--predict times one online cycle here: {missing}", 2)
    if as_json:
        record = machine.as_dict() | ({} if vllm is None else {"vllm": vllm.__dict__})
        record |= {} if prediction is None else {"prediction": prediction}
        console.print(json.dumps(record, indent=2), highlight=False)
    else:
        _print_machine(machine, resolved, vllm)
        for line in [] if prediction is None else prediction["lines"]:
            console.print(line, highlight=False)
    if prediction is not None and prediction["predicted_s"] is None:
        raise typer.Exit(1)


def _print_machine(machine: Machine, resolved: Params, vllm: VllmEnv | None) -> None:
    """The machine as a table (and how to build a vLLM venv where none was found)."""
    quota = "none" if machine.cpu_quota is None else f"{machine.cpu_quota:g} cores' worth"
    bf16 = ", ".join(machine.bf16_units) or "none (bf16 runs through conversions: many times slower than float32)"
    rows = [
        ("CPU", machine.cpu),
        ("cores", f"{machine.cores} (CPU quota: {quota})"),
        ("PyTorch kernels", f"{machine.isa} (CPU flags: {', '.join(machine.cpu_flags) or 'none of AVX2/AVX-512'})"),
        ("bf16 units", bf16),
        ("`host` dtype", machine.host_dtype),
        ("training dtype", f"{machine.train_dtype} (train.compute_dtype: {resolved.train.compute_dtype})"),
        ("vLLM dtype", f"{machine.vllm_dtype or 'vLLM decides'} (serving.vllm_dtype: {resolved.serving.vllm_dtype})"),
        ("python, torch", f"{machine.python}, {machine.torch}"),
    ]
    if vllm is not None:
        found = f"vLLM {vllm.version}" if vllm.version else f"no vLLM: {vllm.problem}"
        rows.append(("vLLM", f"{found} (serving.vllm_python: {vllm.python})"))
    table = Table(title="tabrl doctor: this machine", show_header=False)
    for name, value in rows:
        table.add_row(name, value)
    print_table(table)
    if vllm is not None and vllm.version is None:
        console.print(
            "vLLM arms and evaluations need it: `bash .ci/vllm-venv.sh .venv-vllm`, then "
            "--set serving.vllm_python=$PWD/.venv-vllm/bin/python",
            highlight=False,
        )


def _predict(what: Predict, params_file: str, sets: list[str], requests: int, users: int, probe: int) -> dict:
    """One short online cycle timed here (`flows.demo_plan.probe_cycle`), scaled to `make demo` or to one cycle of
    `requests`: {"predicted_s": ..., the parts, "lines": the prediction in words}."""
    from flows.demo import defaults
    from flows.demo_plan import DEMO_SETTINGS, cycle_wall_s, probe_cycle, scaled
    from tasks.core.config import load_params

    demo = defaults()
    overrides = [*DEMO_SETTINGS, *sets] if what is Predict.demo else sets
    n_users = demo.users if what is Predict.demo else users
    timed = probe_cycle(params_file, overrides, probe, n_users)
    params = load_params(params_file, overrides)
    measured = (
        f"Timed here: one cycle of {timed.requests} requests ({timed.row.requests} decided) in "
        f"{timed.row.traffic_s:.0f} s of traffic, {timed.row.train_s:.0f} s of training, a gate of "
        f"{timed.gate_requests} requests per model in {timed.row.evaluate_s:.0f} s; "
        f"{timed.startup_s:.0f} s to start and stop."
    )
    if timed.row.train_s <= 0 or timed.row.evaluate_s <= 0:
        return {
            "what": what.value,
            "predicted_s": None,
            "lines": [
                measured,
                f"No prediction: the timed cycle did not train and gate a candidate ({timed.row.cycle_status}; "
                f"{timed.row.requests} of {timed.requests} requests decided, the rest cancelled or never shown by "
                "the simulated editors). Where a model answers slower than people type, a cancelling editor "
                "(simulator.client: continue) aborts nearly every request; try --set simulator.client=waits, or "
                "more --probe-requests.",
            ],
        }
    if what is Predict.cycle:
        row = scaled(timed, requests, params.evaluate.n_requests)
        total = cycle_wall_s(row, params)
        return {
            "what": "cycle",
            "requests": requests,
            "gate_requests": params.evaluate.n_requests,
            "predicted_s": total,
            "traffic_s": row.traffic_s,
            "train_s": row.train_s,
            "evaluate_s": row.evaluate_s,
            "lines": [
                measured,
                f"Predicted: one cycle of {requests} requests (gates of {params.evaluate.n_requests}) takes about "
                f"{total / 60:.1f} min here: traffic {row.traffic_s / 60:.1f}, training {row.train_s / 60:.1f}, "
                f"the gate {row.evaluate_s / 60:.1f} min (a run's first cycle adds about {timed.startup_s:.0f} s).",
            ],
        }
    return _demo_prediction(timed, params, demo, measured)


def _demo_prediction(timed: Probe, params: Params, demo: argparse.Namespace, measured: str) -> dict:
    """`make demo` (its arguments `demo`) here, from the timed cycle: the plan it makes after cycle 1 and what it
    runs unattended."""
    from flows.demo_plan import predict_demo

    fill = demo.max_per_arm if demo.ab_fill else 0
    budget_s = 60 * demo.budget_min
    asked, runs = predict_demo(timed, params, demo.cycles, demo.requests, budget_s, demo.mde, demo.power, fill)
    plan = f"{runs.cycles} cycles and an A/B test of {runs.per_arm} requests per arm"
    if runs.filled > runs.per_arm:
        plan += f", extended with what the budget leaves (to about {runs.filled} at cycle 1's pace)"
    if asked.fits:
        verdict = f"`make demo` runs {plan} within its {demo.budget_min:g}-min budget"
    elif runs.cycles < asked.cycles:
        verdict = f"{asked.cycles} cycles do not fit its {demo.budget_min:g}-min budget: `make demo` runs {plan}"
    else:
        verdict = f"no number of cycles fits its {demo.budget_min:g}-min budget: `make demo` runs {plan}, longer"
    return {
        "what": "demo",
        "predicted_s": runs.predicted_s,
        "cycles": runs.cycles,
        "per_arm": runs.per_arm,
        "filled_per_arm": runs.filled,
        "asked_predicted_s": asked.predicted_s,
        "lines": [
            measured,
            f"Predicted: {verdict}, in about {runs.predicted_s / 60:.1f} min (the demo's own run; `make` adds its "
            f"checks). {asked.cycles} cycles would take {asked.predicted_s / 60:.1f} min.",
        ],
    }
