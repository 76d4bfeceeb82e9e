"""Which float type computes: ``float32``, ``bfloat16``, or ``host``, which is bfloat16 where this machine
multiplies bf16 in hardware and float32 where it does not.

On x86 that is a CPU with AMX tiles (Intel Xeon, Sapphire Rapids on) or with AVX512-BF16 instructions (AMD EPYC
Zen 4 on, Intel Cooper Lake). On a CPU with neither, bf16 runs through conversions and is many times slower than
float32; with them, a 300 x 576 x 1536 matrix product ran at 3.4x float32's speed on a Xeon with AMX and 2.7x on
an EPYC (Zen 5) with AVX512-BF16 (docs/results.md, "Compute dtype"). Training (`train.compute_dtype`) and vLLM's
CPU build (`serving.vllm_dtype`) read it here.
"""

from __future__ import annotations

HOST = "host"


def has_bf16_units(device_type: str = "cpu") -> bool:
    """Whether `device_type` ("cpu" or "cuda") multiplies bf16 matrices in hardware: a CUDA GPU that supports
    bf16 (Ampere on), or a CPU with AMX tiles or AVX512-BF16."""
    import torch  # here: the gateway reads params without needing torch loaded

    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(cpu_bf16_units())


def cpu_bf16_units() -> list[str]:
    """This CPU's bf16 hardware: "AMX", "AVX512-BF16", both or neither, by torch's own probes (they read CPUID);
    private names, so a torch without one counts as "no"."""
    import torch

    probes = {"AMX": "_is_amx_tile_supported", "AVX512-BF16": "_is_avx512_bf16_supported"}
    return [unit for unit, name in probes.items() if getattr(torch.cpu, name, lambda: False)()]


def resolve_dtype(name: str, device_type: str = "cpu") -> str:
    """`name` as a concrete dtype: `host` becomes bfloat16 or float32 by `has_bf16_units`; others stay."""
    if name != HOST:
        return name
    return "bfloat16" if has_bf16_units(device_type) else "float32"
