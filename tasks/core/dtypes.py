"""Which float type computes: ``float32``, ``bfloat16``, or ``host``, which is bfloat16 where this machine has
bf16 matrix units and float32 where it has not.

On a CPU without them (AMX on x86), bf16 runs through conversions and is many times slower than float32; with
them, a matrix product runs at ~3.4x float32's speed (measured on the 2-core Xeon of docs/results.md, "Compute
dtype"). Training (`train.compute_dtype`) and vLLM's CPU build (`serving.vllm_dtype`) read it here.
"""

from __future__ import annotations

HOST = "host"


def has_bf16_units(device_type: str = "cpu") -> bool:
    """Whether `device_type` ("cpu" or "cuda") multiplies bf16 matrices in hardware: a CUDA GPU that supports
    bf16 (Ampere on), or a CPU with AMX tiles."""
    import torch  # here: the gateway reads params without needing torch loaded

    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch's own probe (oneDNN reads CPUID)
    return bool(amx is not None and amx())


def resolve_dtype(name: str, device_type: str = "cpu") -> str:
    """`name` as a concrete dtype: `host` becomes bfloat16 or float32 by `has_bf16_units`; others stay."""
    if name != HOST:
        return name
    return "bfloat16" if has_bf16_units(device_type) else "float32"
