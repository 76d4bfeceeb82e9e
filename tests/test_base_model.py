import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.core.fim import QWEN, SPECIAL_TOKENS
from tasks.core.generate import generate, load_model
from tasks.train.base import encode_fim


def test_tokenizer_has_qwen_fim_special_tokens_as_single_ids(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    for special in SPECIAL_TOKENS:
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids) == special
    assert tok.eos_token == QWEN.end and tok.pad_token == "<|fim_pad|>"
    ids = tok(QWEN.render("x = ", "\n"), add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(QWEN.prefix) and ids[-1] == tok.convert_tokens_to_ids(QWEN.middle)
    text = "def f(x):\n\treturn x  # ünïcode\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: lossless


def test_checkpoint_is_a_plain_hf_directory_that_generates(tiny_model_dir):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in tiny_model_dir.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.model_type == "qwen2"
    stats = json.loads((tiny_model_dir / "build_stats.json").read_text())
    assert stats["loss_last10_mean"] < stats["loss_first"]  # pre-training learned something

    model, tok, template = load_model(tiny_model_dir)
    assert template == QWEN  # inferred from the tokenizer's special tokens
    prompts = [QWEN.render("import os\n\ndef main():\n    ", "\n"), QWEN.render("x = ", "")]
    gens = generate(model, tok, template, prompts, max_new_tokens=8, temperature=0.0)
    assert len(gens) == 2
    for gen in gens:
        assert 1 <= len(gen.token_ids) <= 8 and len(gen.logprobs) == len(gen.token_ids)
        assert all(lp <= 0 for lp in gen.logprobs)
        assert QWEN.suffix not in gen.text and QWEN.end not in gen.text


def test_sampled_logprobs_match_a_fresh_forward(tiny_model_dir):
    model, tok, template = load_model(tiny_model_dir)
    prompt = QWEN.render("for i in range(10):\n    ", "\n")
    gen = generate(model, tok, template, [prompt], max_new_tokens=6, temperature=0.8, seed=0)[0]
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    full = torch.tensor([ids + gen.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(ids) - 1 : -1] / 0.8
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(expected, torch.tensor(gen.logprobs), atol=1e-4)


def test_encode_fim_fits_seq_len(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    sample = {"prefix": "a = 1\n" * 200, "suffix": "b = 2\n" * 200, "middle": "c = a + b"}
    ids = encode_fim(tok, sample, 64)
    assert len(ids) <= 64 and ids[-1] == tok.eos_token_id
    assert tok.decode(ids).endswith("<|fim_middle|>c = a + b<|endoftext|>")


def test_long_prompts_are_cut_from_the_oldest_context(tiny_model_dir):
    model, tok, template = load_model(tiny_model_dir)
    prompt = QWEN.render("value = compute(value)\n" * 400, "\n")
    gen = generate(model, tok, template, [prompt], max_new_tokens=4)[0]
    assert len(gen.token_ids) >= 1
    from tasks.core.generate import encode_prompt, prompt_limit

    ids = encode_prompt(tok, prompt, prompt_limit(model, 4), template)
    assert len(ids) == model.config.max_position_embeddings - 4
    assert ids[0] == tok.convert_tokens_to_ids(QWEN.prefix) and ids[-1] == tok.convert_tokens_to_ids(QWEN.middle)


class _Killed(Exception):
    """Stands for the process being killed right after a checkpoint was written."""


def test_an_interrupted_build_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(
    stdlib_files, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    import tasks.train.base as base
    from tests.conftest import tiny_params

    params = tiny_params()
    model = params.model.model_copy(update={"pretrain_steps": 6, "checkpoint_every": 3})
    files = stdlib_files[:40]
    straight = base.build_base(files, model, params.fim, params.traffic, tmp_path / "straight")
    assert not (tmp_path / "straight.partial").exists()  # a finished build leaves no checkpoint behind

    real_pretrain = base.pretrain

    def killed_after_first_checkpoint(*args, **kwargs):
        def die(step):
            raise _Killed(step)

        return real_pretrain(*args, **{**kwargs, "snapshot": die})

    monkeypatch.setattr(base, "pretrain", killed_after_first_checkpoint)
    try:
        base.build_base(files, model, params.fim, params.traffic, tmp_path / "resumed", snapshots=True)
    except _Killed as killed:
        assert killed.args == (3,)
    monkeypatch.setattr(base, "pretrain", real_pretrain)
    assert (tmp_path / "resumed.partial" / "trainer.pt").is_file() and not (tmp_path / "resumed").exists()
    resumed = base.build_base(files, model, params.fim, params.traffic, tmp_path / "resumed")
    assert resumed["loss_last10_mean"] == pytest.approx(straight["loss_last10_mean"], rel=1e-5)
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_the_shipped_base_is_current_with_its_code_so_dvc_repro_keeps_it():
    """dvc.lock records the code the committed base was built from; a change to any of it makes every fresh
    clone's `dvc repro` (and so `make demo`) rebuild the base, an hour and more on 2 cores. Code that does
    not change what the base is built from belongs outside the base stage's deps."""
    import hashlib
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["base"]
    stage = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["base"]
    assert sorted(d["path"] for d in lock["deps"]) == sorted(stage["deps"])
    for dep in lock["deps"]:
        md5 = hashlib.md5((root / dep["path"]).read_bytes()).hexdigest()
        assert md5 == dep["md5"], f"{dep['path']} changed since the shipped base was built (dvc repro would rebuild it)"
