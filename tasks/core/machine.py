"""What this machine is, as the figures in docs/results.md name it: the CPU, its cores (and any CPU quota), the
instruction set PyTorch's kernels use, whether it multiplies bf16 in hardware, and the dtypes params resolve to
here; and the vLLM environment serving.vllm_python names. `tabrl doctor` prints it; benchmarks record it.

The instruction set is PyTorch's own choice (``torch.backends.cpu.get_cpu_capability``), so an emulated slow
machine (``ATEN_CPU_CAPABILITY=avx2``) reads as the machine it emulates; the CPU's own flags are beside it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.core.config import Params
from tasks.core.dtypes import HOST, cpu_bf16_units, resolve_dtype

VLLM_PROBE_TIMEOUT_S = 120.0  # importing vLLM's CPU build takes 10-30 s on 2 cores


@dataclass(frozen=True)
class Machine:
    cpu: str  # the model name the CPU reports
    cores: int  # this process may run on (its affinity)
    cpu_quota: float | None  # cores' worth the cgroup allows (cpu.max), None: no quota
    isa: str  # what PyTorch's CPU kernels use: AVX512, AVX2, DEFAULT (ATEN_CPU_CAPABILITY lowers it)
    cpu_flags: tuple[str, ...]  # the vector extensions the CPU itself has (avx2, avx512f, avx512_bf16, amx_tile)
    bf16_units: tuple[str, ...]  # AMX, AVX512-BF16, or none: bf16 without them runs many times slower
    host_dtype: str  # what `host` resolves to here
    train_dtype: str  # train.compute_dtype, resolved
    vllm_dtype: str | None  # serving.vllm_dtype, resolved; None: vLLM's own choice
    python: str
    torch: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VllmEnv:
    python: str  # serving.vllm_python
    version: str | None  # None: no vLLM there
    problem: str = ""  # why not, in a sentence


def describe(params: Params) -> Machine:
    import torch

    from tasks.core.vllm import server_dtype

    cpuinfo = _cpuinfo()
    return Machine(
        cpu=_cpu_model(cpuinfo),
        cores=len(os.sched_getaffinity(0)),
        cpu_quota=_cpu_quota(),
        isa=torch.backends.cpu.get_cpu_capability(),
        cpu_flags=_vector_flags(cpuinfo),
        bf16_units=tuple(cpu_bf16_units()),
        host_dtype=resolve_dtype(HOST),
        train_dtype=resolve_dtype(params.train.compute_dtype, "cuda" if torch.cuda.is_available() else "cpu"),
        vllm_dtype=server_dtype(params.serving),
        python=platform.python_version(),
        torch=torch.__version__,
    )


def vllm_env(params: Params) -> VllmEnv:
    """The vLLM that serving.vllm_python imports, and its version (a subprocess: its pins are not ours)."""
    python = params.serving.vllm_python
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=VLLM_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return VllmEnv(python, None, f"{python} did not run: {err}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return VllmEnv(python, None, f"{python} cannot import vllm ({last})")
    return VllmEnv(python, done.stdout.strip().splitlines()[-1])


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    for line in _read("/proc/cpuinfo").split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_model(fields: dict[str, str]) -> str:
    """The model name, with its family and model numbers (a VM may say only "AMD EPYC": family 26 is Zen 5)."""
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def _vector_flags(fields: dict[str, str]) -> tuple[str, ...]:
    have = set(fields.get("flags", "").split())
    return tuple(flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if flag in have)


def _cpu_quota() -> float | None:
    """Cores' worth of CPU time the cgroups (v2 `cpu.max`, v1 `cpu.cfs_quota_us`) allow this process: the tightest
    quota on the way from its own group (/proc/self/cgroup) up to the root; None: none."""
    quotas = []
    for group in _cgroup_dirs():
        v2 = _read(f"{group}/cpu.max").split()
        if len(v2) == 2 and v2[0] != "max":
            quotas.append(int(v2[0]) / int(v2[1]))
        quota, period = _read(f"{group}/cpu.cfs_quota_us"), _read(f"{group}/cpu.cfs_period_us")
        if quota.strip().lstrip("-").isdigit() and int(quota) > 0 and period.strip().isdigit():
            quotas.append(int(quota) / int(period))
    return min(quotas, default=None)


def _cgroup_dirs() -> list[str]:
    """The cgroup directories whose CPU limits apply to this process: its own (v2, and v1's `cpu` controller) and
    every parent up to the root."""
    dirs = []
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" or "cpu" in controllers.split(","):
            root = "/sys/fs/cgroup" if controllers == "" else "/sys/fs/cgroup/cpu"
            parts = [part for part in path.strip().split("/") if part]
            dirs += [root + "".join(f"/{part}" for part in parts[:depth]) for depth in range(len(parts), -1, -1)]
    return dirs or ["/sys/fs/cgroup", "/sys/fs/cgroup/cpu"]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
