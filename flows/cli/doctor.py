"""`tabrl doctor`: what this machine is, as every figure in docs/results.md names it, and what that means here."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.console import ParamsOpt, SetOpt, console, params_or_exit, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE
from tasks.core.machine import describe, vllm_env


def doctor_cmd(
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
    no_vllm: Annotated[bool, typer.Option("--no-vllm", help="Skip importing vLLM (10-30 s on 2 cores).")] = False,
) -> None:
    """Print this machine's CPU, cores and CPU quota, the instruction set PyTorch's kernels use (AVX-512 or
    AVX2), whether it multiplies bf16 in hardware, the dtypes `host` and this config resolve to, and the vLLM
    that serving.vllm_python imports (its version). Quote it beside any figure you measure here."""
    resolved = params_or_exit(params, set_)
    machine = describe(resolved)
    vllm = None if no_vllm else vllm_env(resolved)
    if as_json:
        record = machine.as_dict() | ({} if vllm is None else {"vllm": vllm.__dict__})
        console.print(json.dumps(record, indent=2), highlight=False)
        return
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
