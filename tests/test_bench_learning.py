"""bench.learning's stored runs: which params make a stored (setting, seed) result reusable."""

import argparse
from pathlib import Path

import pytest

from bench.learning import run_key
from tasks.core.config import load_params

REPO = Path(__file__).resolve().parents[1]
LOOP = argparse.Namespace(cycles=3, requests=500, users=16, corpus=None)


def _key(monkeypatch, bf16_units: bool, *overrides: str) -> str:
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
    overlays = [f"@{REPO / 'params.vllm-cpu.yaml'}", "train.compute_dtype=host", "model.base_dir=models/tabrl-tiny"]
    params = load_params(REPO / "params.yaml", [*overlays, *overrides], environ={})
    return run_key(params, LOOP)


def test_a_stored_run_is_keyed_by_the_dtypes_it_computed_in_not_by_host(monkeypatch):
    """`host` on a CPU without bf16 units computes what an explicit float32 does, so a run stored there is reused
    under float32 anywhere; `host` on a CPU with them computes in bfloat16: another run. Where vLLM is installed
    is not part of the run, the loop's size is."""
    float32 = ["train.compute_dtype=float32", "serving.vllm_dtype=float32"]
    stored = _key(monkeypatch, False)
    assert _key(monkeypatch, True, *float32) == stored
    assert _key(monkeypatch, False, "serving.vllm_python=/opt/vllm/bin/python") == stored
    assert _key(monkeypatch, True) != stored
    assert _key(monkeypatch, False, "train.compute_dtype=bfloat16") != stored
    assert _key(monkeypatch, False, "train.lr=1e-3") != stored
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LOOP, "requests", 200)
        assert _key(monkeypatch, False) != stored


def test_the_final_table_gives_each_seed_alone_beside_the_pooled_difference():
    """With seeds that disagree the pooled interval is wide; the rows per seed say which seed did what."""
    from bench.learning import final_table

    # per session: requests, shown, accepted, right, saved chars, typed chars
    base = [[10, 5, 1, 1, 10, 100]] * 30
    better = [[10, 5, 3, 3, 40, 100]] * 30
    finals = {"control": [base, base], "defaults": [better, base]}
    reward = load_params(REPO / "params.yaml", [], environ={}).reward
    lines, numbers = final_table(finals, reward, [3, 7])
    assert numbers["defaults - control, seed 3"]["chars_saved"][:3] == pytest.approx([0.3, 0.3, 0.3])
    assert numbers["defaults - control, seed 7"]["chars_saved"][:3] == pytest.approx([0.0, 0.0, 0.0])
    assert numbers["defaults - control"]["chars_saved"][0] == pytest.approx(0.15)
    rows = [line for line in lines if line.startswith("| defaults, seed")]
    assert [row.split(" |")[0] for row in rows] == ["| defaults, seed 3 alone", "| defaults, seed 7 alone"]
    assert "+0.3000 [+0.3000, +0.3000] *" in rows[0] and "+0.0000 [+0.0000, +0.0000] |" in rows[1]
    _, one_seed = final_table({"control": [base], "defaults": [better]}, reward, [0])
    assert not any(", seed" in key for key in one_seed)  # one seed: the pooled row is that seed
