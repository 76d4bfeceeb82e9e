"""train.adapter = lora: the update trains a PEFT adapter on the base, saves only it with its base's identity,
continues the champion's adapter, and refuses a base it was not trained on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.core.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE_FILE,
    AdapterBaseError,
    checkpoint_sha256,
    read_base,
)
from tasks.core.fim import read_template
from tasks.core.generate import generate, load_model
from tasks.train.launch import launch_train
from tasks.train.policy import StartError
from tasks.train.ppo import train
from tests.conftest import tiny_params
from tests.support.training import sampled_snapshot

MAX_NEW = 8
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, tiny_model_dir, fim_samples) -> Path:
    return sampled_snapshot(tiny_model_dir, fim_samples[:16], tmp_path_factory.mktemp("snap") / "s.parquet", 8, 0.7)


def _params(tmp, **train):
    base = {
        "adapter": "lora",
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lr": 5e-3,
        "epochs": 1,
        "micro_batch": 8,
        "grad_accum": 1,
        "grad_clip": 1e6,
        "max_approx_kl": 10.0,
        "target_kl": 10.0,
    }
    return tiny_params(tmp, train=base | train, serving={"max_tokens": MAX_NEW, "temperature": TEMPERATURE})


def test_a_lora_update_saves_only_an_adapter_and_the_identity_of_its_base(tiny_model_dir, snapshot, tmp_path):
    out = tmp_path / "v2"
    result = train(snapshot, tiny_model_dir, out, _params(tmp_path, micro_batch=32))
    assert (result.weights, result.steps, result.base_dir) == ("lora", 1, str(tiny_model_dir))
    files = {p.name for p in out.iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, "fim_template.json", "train_result.json"} <= files
    assert "model.safetensors" not in files  # MBs, not a copy of the base
    assert read_base(out).sha256 == checkpoint_sha256(tiny_model_dir)
    assert read_template(out) == read_template(tiny_model_dir)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    weights = load_file(out / ADAPTER_WEIGHTS)
    assert all("lora_" in name for name in weights)
    # B starts at zero (the fresh adapter is the base); one step moved every B
    assert all(w.abs().sum() > 0 for name, w in weights.items() if "lora_B" in name)
    # the version runs as base + adapter: loaded merged, its weights differ from the base where adapted only
    merged = load_model(out).model.state_dict()
    base = load_model(tiny_model_dir).model.state_dict()
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


def test_the_next_version_continues_the_champions_adapter_on_the_same_base(tiny_model_dir, snapshot, tmp_path):
    first = tmp_path / "v2"
    train(snapshot, tiny_model_dir, first, _params(tmp_path))
    second = tmp_path / "v3"
    result = train(snapshot, first, second, _params(tmp_path, micro_batch=32, lora_rank=8))
    # the proximal policy is the starting weights, base + v2's adapter: the first step's KL to them is 0
    assert result.final["train/approx_kl"] == pytest.approx(0.0, abs=1e-5)
    assert read_base(second) == read_base(first)  # still the base, not v2
    assert json.loads((second / ADAPTER_CONFIG).read_text())["r"] == 4  # the adapter keeps its own rank
    a, b = load_file(first / ADAPTER_WEIGHTS), load_file(second / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    # v3 generates as base + its adapter, whichever way it is loaded
    model, tok, template = load_model(second)
    assert generate(model, tok, template, ["def f(x):\n    return "], 4)[0].token_ids


def test_an_adapter_is_never_used_on_another_base(tiny_model_dir, babbler_dir, snapshot, tmp_path):
    first = tmp_path / "v2"
    train(snapshot, tiny_model_dir, first, _params(tmp_path))
    with pytest.raises(AdapterBaseError, match="trained on another base"):
        train(snapshot, first, tmp_path / "v3", _params(tmp_path), base_dir=babbler_dir)
    with pytest.raises(AdapterBaseError, match="trained on another base"):
        load_model(first, base_dir=babbler_dir)
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    (moved / BASE_FILE).unlink()
    with pytest.raises(AdapterBaseError, match="cannot tell which base"):
        load_model(moved)
    assert not (tmp_path / "v3").exists()


def test_an_adapter_cannot_be_trained_as_full_weights(tiny_model_dir, snapshot, tmp_path):
    first = tmp_path / "v2"
    train(snapshot, tiny_model_dir, first, _params(tmp_path))
    with pytest.raises(StartError, match="train.adapter is none"):
        train(snapshot, first, tmp_path / "v3", _params(tmp_path, adapter="none"))


def test_two_gloo_ranks_train_the_adapter_one_process_does(tiny_model_dir, snapshot, tmp_path):
    one = launch_train(snapshot, tiny_model_dir, tmp_path / "one", _params(tmp_path, micro_batch=4, grad_accum=2))
    two = launch_train(
        snapshot, tiny_model_dir, tmp_path / "two", _params(tmp_path, micro_batch=4, grad_accum=1, nproc=2)
    )
    assert (one.world_size, two.world_size, one.steps, two.steps) == (1, 2, 2, 2)
    assert one.final["train/grad_norm"] == pytest.approx(two.final["train/grad_norm"], rel=1e-4)
    a, b = load_file(tmp_path / "one" / ADAPTER_WEIGHTS), load_file(tmp_path / "two" / ADAPTER_WEIGHTS)
    # Adam divides each gradient by its own running size, so an element whose gradient is near 0 moves by a step
    # that depends on the last bits of the sum (one rank accumulating vs two all-reducing): one lora_B element of
    # 512 differed by 1.3e-5 on one machine's CPU. Ranks that did not average gradients step lr (5e-3) elsewhere.
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-4, rtol=1e-3), name
