"""Evaluating the tiny model: against itself no gate passes; MLflow gets metrics, table, plot; the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from typer.testing import CliRunner

from flows.cli.main import app
from tasks.evaluate.evaluate import METRICS, compare, evaluate_model
from tasks.sim.corpus import write_samples
from tasks.sim.editor import write_regions
from tests.conftest import tiny_params
from tests.test_evaluate_judge import KEY_ENV, FakeJudge


@pytest.fixture
def mlflow_run(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = mlflow.create_experiment("eval-test", artifact_location=str(tmp_path / "artifacts"))
    with mlflow.start_run(experiment_id=experiment) as run:
        yield run
    mlflow.set_tracking_uri(None)


def test_tiny_model_against_itself_passes_no_gate_and_logs_to_mlflow(
    tiny_model_dir, fim_samples, typing_regions, tmp_path, mlflow_run
):
    params = tiny_params(tmp_path, evaluate={"n_samples": 8, "max_new_tokens": 8})
    result = compare(tiny_model_dir, tiny_model_dir, fim_samples, typing_regions, params)
    cand, champ = result.candidate, result.champion
    assert set(cand.metrics) == set(METRICS)
    assert len(cand.rows) == params.evaluate.n_samples == 8
    # Same model, same greedy decoding, same users: identical numbers, and equal is not better.
    assert [r["completion"] for r in cand.rows] == [r["completion"] for r in champ.rows]
    for name in METRICS:
        if name != "eval/latency_ms":
            assert cand.metrics[name] == champ.metrics[name], name
    assert not result.decision.passed
    assert result.decision.reasons[-1].startswith("FAIL")
    assert cand.judge == "reference" and result.judge_requests == 0
    m = cand.metrics
    assert 0 <= m["eval/suggest_rate"] <= 1 and 0 <= m["eval/accept_rate"] <= 1 and 0 <= m["eval/judge_mean"] <= 10
    assert m["eval/judge_scored"] + m["eval/judge_unscored"] == round(8 * m["eval/suggest_rate"])
    rewards = {"accepted": 0.75, "rejected": -0.25, "abstained": 0.0}
    assert m["eval/reward_per_request"] == pytest.approx(sum(rewards[r["outcome"]] for r in cand.rows) / 8)
    assert m["eval/latency_ms"] > 0
    typed = cand.typing  # editor traffic: at least evaluate.n_requests, the summary is the turns' own
    assert m["eval/typing/requests"] == len(typed.turns) == params.evaluate.n_requests
    assert m["eval/typing/chars_saved"] == pytest.approx(
        sum(t.saved_chars for t in typed.turns) / sum(s[5] for s in typed.sessions)
    )
    assert 0 <= m["eval/typing/right_rate"] <= 1 and sum(s[0] for s in typed.sessions) == len(typed.turns)

    client = mlflow.tracking.MlflowClient()
    logged = client.get_run(mlflow_run.info.run_id).data
    assert logged.metrics["eval/judge_mean"] == pytest.approx(m["eval/judge_mean"])
    assert logged.metrics["eval/champion/reward_per_request"] == pytest.approx(champ.metrics["eval/reward_per_request"])
    assert logged.metrics["eval/gate_passed"] == 0.0
    assert logged.tags["eval.judge"] == "reference"
    artifacts = {a.path for a in client.list_artifacts(mlflow_run.info.run_id, "eval")}
    assert {"eval/samples.json", "eval/metrics.png", "eval/gate.json"} <= artifacts
    local = client.download_artifacts(mlflow_run.info.run_id, "eval/samples.json", str(tmp_path))
    table = json.loads(open(local).read())
    assert len(table["data"]) == 16 and "judge_score" in table["columns"] and "model" in table["columns"]


def test_the_lineage_mark_is_typed_through_the_gates_own_requests(
    tiny_model_dir, fim_samples, typing_regions, tmp_path
):
    """The ancestor holding the lineage's characters-saved mark types the same requests as candidate and
    champion: its score there, not one carried over from other requests, is the mark."""
    from tasks.sim.acceptance import typing_acceptance

    shipped = Path(__file__).resolve().parents[1] / "models" / "tabrl-tiny"  # right now and then: it saves some
    params = tiny_params(tmp_path, evaluate={"n_samples": 4, "n_requests": 200, "max_new_tokens": 8})
    plain = compare(tiny_model_dir, tiny_model_dir, fim_samples, typing_regions, params)
    marked = compare(tiny_model_dir, tiny_model_dir, fim_samples, typing_regions, params, mark_dir=shipped)
    holder = typing_acceptance(shipped, typing_regions, params).summary.chars_saved
    champ = marked.champion.metrics["eval/typing/chars_saved"]
    assert holder > champ  # the shipped base is right where the test-size model is not
    assert plain.decision.numbers["mark/chars_saved"] == champ and plain.decision.mark_held_by == "candidate"
    assert marked.decision.numbers["mark/chars_saved"] == pytest.approx(holder)
    assert marked.decision.mark_held_by == "lineage"  # the candidate saves less: the mark stays with the holder
    assert any(f"the lineage's best {holder:.4f}" in r for r in marked.decision.reasons), marked.decision.reasons


def test_gates_take_turns_over_windows_of_the_first_half_never_the_unseen_half(typing_regions):
    from tasks.sim.acceptance import gate_regions, unseen_regions

    half = typing_regions[: len(typing_regions) // 2]
    unseen = {r.region_id for r in unseen_regions(typing_regions)}
    starts = [gate_regions(typing_regions, w, 3)[0] for w in range(3)]
    assert [r.region_id for r in starts] == [half[0].region_id, half[4].region_id, half[8].region_id]
    for w in range(3):
        window = gate_regions(typing_regions, w, 3)
        assert sorted(r.region_id for r in window) == sorted(r.region_id for r in half)  # round the half
        assert not unseen & {r.region_id for r in window}
    assert gate_regions(typing_regions, 0, 1) == half  # one window: every gate types the same requests
    with pytest.raises(ValueError, match="gate window 3 is not one of the 3 windows"):
        gate_regions(typing_regions, 3, 3)


def test_llm_judged_self_comparison_is_cached_and_not_better(
    babbler_dir, fim_samples, typing_regions, tmp_path, monkeypatch
):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    fake = FakeJudge()
    fake.thread.start()
    try:
        params = tiny_params(
            tmp_path,
            evaluate={
                "n_samples": 8,
                "max_new_tokens": 8,
                "judge": {
                    "kind": "llm",
                    "base_url": fake.url,
                    "model": "judge-test",
                    "api_key_env": KEY_ENV,
                    "cache_path": str(tmp_path / "judge.sqlite"),
                    "max_retries": 0,
                },
            },
        )
        result = compare(babbler_dir, babbler_dir, fim_samples, typing_regions, params)
        cand = result.candidate
        assert all(r["completion"].strip() for r in cand.rows)  # every request shows a suggestion
        distinct = len({(s["prefix"], s["suffix"]) for s in fim_samples[:8]})
        # Both models' identical completions share prompts: each is asked once.
        assert result.judge_requests == len(fake.requests) == distinct
        assert cand.judge == "llm:judge-test"
        assert cand.metrics["eval/judge_mean"] == 8.0 and cand.metrics["eval/judge_scored"] == 8
        assert cand.metrics["eval/judge_unscored"] == 0 and cand.metrics["eval/suggest_rate"] == 1.0
        assert not result.decision.passed
        assert any("equal is not better" in r for r in result.decision.reasons)
        assert result.decision.numbers["evidence/candidate_judge_scored"] == 8
        again = evaluate_model(babbler_dir, fim_samples, typing_regions, params)
        assert len(fake.requests) == distinct  # the re-evaluation cost nothing
        assert again.metrics["eval/judge_mean"] == 8.0
    finally:
        fake.server.shutdown()
        fake.server.server_close()


def test_cli_prints_side_by_side_table_and_gate(babbler_dir, tiny_model_dir, fim_samples, typing_regions, tmp_path):
    test = tmp_path / "test.parquet"
    write_samples(fim_samples, test)
    regions = write_regions(typing_regions, tmp_path / "typing.parquet", tiny_params().traffic)
    out = tmp_path / "eval.json"
    sets = ["evaluate.n_samples=6", "evaluate.n_requests=12", "evaluate.max_new_tokens=8", "evaluate.batch_size=6"]
    sets.append("serving.min_logprob=null")  # the babbler's suggestions shown whole: the show rule would hide them
    args = [
        "evaluate",
        "--model",
        str(babbler_dir),
        "--against",
        str(tiny_model_dir),
        "--test",
        str(test),
        "--regions",
        str(regions),
        "--json",
        str(out),
        "--params",
        "params.yaml",
    ] + [x for s in sets for x in ("--set", s)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "eval/typing/chars_saved" in result.output and "champion" in result.output
    assert "gate: FAIL" in result.output and "reward_per_request drops" in result.output
    saved = json.loads(out.read_text())
    assert saved["gate"]["passed"] is False
    assert saved["candidate"]["eval/suggest_rate"] == 1.0 and saved["champion"]["eval/suggest_rate"] == 0.0
    assert saved["candidate"]["eval/reward_per_request"] < 0 == saved["champion"]["eval/reward_per_request"]
    assert (
        saved["candidate"]["eval/typing/reward_per_request"] < 0 == saved["champion"]["eval/typing/reward_per_request"]
    )
    assert saved["candidate"]["eval/typing/requests"] == 12

    missing = CliRunner().invoke(app, ["evaluate", "--model", str(tmp_path / "nope"), "--test", str(test)])
    assert missing.exit_code == 2 and "not a model directory" in missing.output


def test_middle_loss_scores_each_continuation_token_after_what_came_before(tiny_model_dir, fim_samples):
    """middle_loss (one forward pass per request) equals the mean -log p of each true continuation token
    and the end token, each read from a forward pass over the prompt and the tokens before it only."""
    import math

    import torch

    from tasks.core.generate import load_model
    from tasks.sim.acceptance import middle_loss

    lm = load_model(tiny_model_dir)
    requests = [dict(s) for s in fim_samples[:3]]
    end = lm.tokenizer.convert_tokens_to_ids(lm.template.end)
    nats = []
    with torch.no_grad():
        for q in requests:
            ids = lm.tokenizer(lm.template.render(q["prefix"], q["suffix"]), add_special_tokens=False)["input_ids"]
            for token in lm.tokenizer(q["middle"], add_special_tokens=False)["input_ids"] + [end]:
                logits = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
                nats.append(-float(torch.log_softmax(logits, -1)[token]))
                ids = ids + [token]
    assert math.isclose(middle_loss(lm, requests, tiny_params().serving), sum(nats) / len(nats), rel_tol=1e-4)


def test_the_demo_story_pairs_base_and_final_on_the_same_held_out_typing(
    tiny_model_dir, babbler_dir, typing_regions, tmp_path
):
    """`make demo` ends with base vs final champion (flows/report.print_story); the change is paired."""
    from flows.report import print_story
    from tasks.sim.acceptance import typing_acceptance, unseen_regions
    from tasks.sim.editor import read_regions, regions_path

    params = tiny_params(tmp_path, evaluate={"n_requests": 64, "max_new_tokens": 4})
    regions = write_regions(typing_regions, regions_path(params.paths.data_dir, "test"), params.traffic)
    story = print_story(tiny_model_dir, babbler_dir, tmp_path, params)
    assert json.loads((tmp_path / "story.json").read_text()) == story
    # typed where no gate evaluation reached: the second half of the held-out regions
    gate = typing_acceptance(tiny_model_dir, read_regions(regions), params)
    assert len(gate.sessions) < len(typing_regions) // 2
    base = typing_acceptance(tiny_model_dir, unseen_regions(read_regions(regions)), params).summary
    assert base.requests == params.evaluate.n_requests
    assert story["suggest_rate"]["base"][0] == pytest.approx(base.suggest_rate)
    assert story["suggest_rate"]["final"][0] == 1.0  # the babbler always shows something
    for name, numbers in story.items():
        change, (low, high) = numbers["change"][0], numbers["change"][1:]
        assert change == pytest.approx(numbers["final"][0] - numbers["base"][0]) and low <= change <= high, name
    # the test-size base never shows a suggestion: a model that always does is a change beyond doubt
    assert base.suggest_rate == 0.0 and story["suggest_rate"]["change"][1] > 0
    assert story["reward_per_request"]["change"][2] < 0  # wrong suggestions shown cost reward


def test_a_models_fim_completions_are_made_once_and_remembered(
    tiny_model_dir, babbler_dir, tiny_adapter_dir, fim_samples, tmp_path, monkeypatch
):
    """fim_completions: the samples a model completed before come from the cache with the texts it made, only
    the new ones reach the engine; another model, another completion length or the cache off complete them all.
    An adapter is another model than its base."""
    from tasks.core.engines import open_engine
    from tasks.evaluate import completions

    made: list[int] = []
    real = completions.complete_samples

    def counted(engine, samples, params, desc="generate"):
        made.append(len(samples))
        return real(engine, samples, params, desc=desc)

    monkeypatch.setattr(completions, "complete_samples", counted)
    params = tiny_params(tmp_path, evaluate={"max_new_tokens": 8})
    with open_engine(tiny_model_dir, params) as engine:
        first, first_ms = completions.fim_completions(engine, tiny_model_dir, fim_samples[:12], params)
        again, _ = completions.fim_completions(engine, tiny_model_dir, fim_samples[:16], params)
        assert made == [12, 4] and again[:12] == first and first_ms > 0
        assert completions.fim_completions(engine, tiny_model_dir, fim_samples[:12], params) == (first, first_ms)
    with open_engine(babbler_dir, params) as engine:
        other, _ = completions.fim_completions(engine, babbler_dir, fim_samples[:12], params)
    assert made == [12, 4, 12] and other != first  # the babbler always shows something
    adapter = completions.model_identity(tiny_adapter_dir)
    assert adapter == completions.model_identity(tiny_adapter_dir) != completions.model_identity(tiny_model_dir)
    for n, changed in enumerate(({"max_new_tokens": 6}, {"max_new_tokens": 8, "completion_cache": False})):
        fresh = tiny_params(tmp_path, evaluate=changed)
        with open_engine(tiny_model_dir, fresh) as engine:
            texts, _ = completions.fim_completions(engine, tiny_model_dir, fim_samples[:12], fresh)
        assert made == [12, 4, 12, *[12] * (n + 1)]
    assert texts == first  # the cache off: the same model's completions, made again
