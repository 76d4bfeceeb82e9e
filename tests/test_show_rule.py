"""The show rule (serving.min_logprob): a suggestion is shown only up to the model's first unsure token, the
same way in generate (embedded arms, evaluation), in the vLLM answer mapping and through the gateway."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from serving.auth import add_key
from serving.gateway import create_app
from tasks.core.config import ServingParams
from tasks.core.fim import parse_completion
from tasks.core.generate import ShowRule, generate, load_model, show_rule, stops_of
from tasks.core.greedy_rule import rule_logprobs
from tasks.core.inference import InProcess
from tasks.core.store import Arm, Store, completions, init_schema, replace_arms
from tasks.core.vllm import VllmError, generation_from_vllm
from tasks.sim.acceptance import type_regions
from tests.conftest import tiny_params
from tests.serving_util import post_completions, serve_app

BASE = Path(__file__).resolve().parents[1] / "models" / "tabrl-tiny"  # the shipped base: it is sure of some tokens


@pytest.fixture(scope="module")
def lm():
    return load_model(BASE)


def _prompts(lm, fim_samples, n=12):
    return [lm.template.render(s["prefix"][-300:], s["suffix"][:100]) for s in fim_samples[:n]]


def _shown_logprobs(gen) -> list[float]:
    """Log-probs of the tokens that show text (the stop token that ended a completion shows none)."""
    return gen.logprobs[:-1] if gen.finish_reason == "stop" and gen.token_ids else gen.logprobs


def test_first_unsure_skips_the_stop_token_and_show_rule_reads_params():
    rule = ShowRule(-1.0, 0.3)
    assert rule.first_unsure([-0.1, -0.5, -2.0, -0.2], stopped=False) == 2
    assert rule.first_unsure([-0.1, -0.5, -3.0], stopped=True) is None  # only the stop token is unsure
    assert rule.first_unsure([-1.5], stopped=False) == 0
    assert show_rule(ServingParams(min_logprob=None, temperature=0.3)) is None
    assert show_rule(ServingParams(min_logprob=-0.5, temperature=0.3)) == ShowRule(-0.5, 0.3)
    # greedy serving: the model's own distribution
    assert show_rule(ServingParams(min_logprob=-0.5, temperature=0.0)) == ShowRule(-0.5, 1.0)


def test_a_greedy_suggestion_is_cut_exactly_before_its_first_unsure_token(lm, fim_samples):
    prompts = _prompts(lm, fim_samples)
    whole = generate(*lm, prompts, 12)
    # A threshold just above the lowest log-prob of a suggestion whose first token is not its least sure.
    i, g = next(
        (i, g)
        for i, g in enumerate(whole)
        if len(_shown_logprobs(g)) >= 2 and min(_shown_logprobs(g)) < _shown_logprobs(g)[0]
    )
    lps = _shown_logprobs(g)
    j = lps.index(min(lps))
    rule = ShowRule(lps[j] + 1e-4, 1.0)
    cut = generate(*lm, prompts, 12, rule=rule)
    stops = stops_of(lm.template, lm.tokenizer)
    assert cut[i].token_ids == g.token_ids[:j] and cut[i].logprobs == pytest.approx(g.logprobs[:j])
    assert cut[i].text == parse_completion(lm.tokenizer.decode(g.token_ids[:j], skip_special_tokens=False), stops)
    assert g.text.startswith(cut[i].text) and len(cut[i].text) < len(g.text)
    for w, c in zip(whole, cut, strict=True):  # every other suggestion: its sure part, never more
        assert w.token_ids[: len(c.token_ids)] == c.token_ids
        assert all(lp >= rule.min_logprob for lp in _shown_logprobs(c))


def test_the_rule_compares_log_probs_at_its_own_temperature(lm, fim_samples):
    """Greedy evaluation applies the serving temperature's rule: sharper than T = 1, so it keeps at least as much."""
    prompts = _prompts(lm, fim_samples)
    at_1 = generate(*lm, prompts, 12, rule=ShowRule(-0.7, 1.0))
    at_03 = generate(*lm, prompts, 12, rule=ShowRule(-0.7, 0.3))
    assert all(len(a.token_ids) <= len(b.token_ids) for a, b in zip(at_1, at_03, strict=True))
    assert sum(len(b.token_ids) for b in at_03) > sum(len(a.token_ids) for a in at_1)
    # Sampled at the rule's temperature: the logged (behaviour) log-probs are the ones the rule compared.
    sampled = generate(*lm, prompts, 12, temperature=0.7, seed=3, rule=ShowRule(-1.0, 0.7))
    assert all(lp >= -1.0 for g in sampled for lp in _shown_logprobs(g))


def _forwards(lm, call) -> tuple[list, int]:
    """(call's result, how many forwards the model's output layer ran for it)."""
    seen = []
    hook = lm.model.get_output_embeddings().register_forward_hook(lambda *_: seen.append(1))
    try:
        return call(), len(seen)
    finally:
        hook.remove()


@pytest.mark.parametrize(("temperature", "rule"), [(0.0, ShowRule(-0.25, 1.0)), (0.3, ShowRule(-0.25, 0.3))])
def test_generation_ends_at_the_first_unsure_token_and_shows_and_logs_the_same(lm, fim_samples, temperature, rule):
    """A batch stops once every row is cut or stopped; each row's suggestion, tokens and log-probs are those of the
    whole generation cut by the rule afterwards (same seed: the same draws up to every cut)."""
    prompts = _prompts(lm, fim_samples, n=16)
    whole, whole_steps = _forwards(lm, lambda: generate(*lm, prompts, 24, temperature=temperature, seed=7))
    cut, cut_steps = _forwards(lm, lambda: generate(*lm, prompts, 24, temperature=temperature, seed=7, rule=rule))
    stops = stops_of(lm.template, lm.tokenizer)
    for w, c in zip(whole, cut, strict=True):
        unsure = rule.first_unsure(w.logprobs, w.finish_reason == "stop")
        keep = len(w.token_ids) if unsure is None else unsure
        assert c.token_ids == w.token_ids[:keep] and c.logprobs == w.logprobs[:keep]
        shown = w.text if unsure is None else parse_completion(lm.tokenizer.decode(w.token_ids[:keep]), stops)
        assert c.text == shown
    assert sum(1 for w in whole if rule.first_unsure(w.logprobs, w.finish_reason == "stop") == 0) >= 1
    assert cut_steps < whole_steps  # the rows cut early took no more forwards than the longest kept row


def test_min_logprob_zero_shows_nothing(lm, fim_samples):
    gens = generate(*lm, _prompts(lm, fim_samples), 12, rule=ShowRule(0.0, 1.0))
    assert [g.text for g in gens] == [""] * len(gens)


def _vllm_body(tokens, lps, finish="stop"):
    return {
        "choices": [
            {
                "text": "".join(t for t in tokens if t != "<|endoftext|>"),
                "finish_reason": finish,
                "token_ids": list(range(10, 10 + len(tokens))),
                "logprobs": {"token_logprobs": lps, "tokens": tokens},
            }
        ]
    }


def test_a_vllm_answer_is_cut_by_its_token_strings():
    stops = ["<|endoftext|>"]
    body = _vllm_body(["foo", "(", "bar", ")", "<|endoftext|>"], [-0.1, -0.2, -2.5, -0.1, -4.0])
    assert generation_from_vllm(body, stops, 1.0).text == "foo(bar)"  # no rule: whole
    cut = generation_from_vllm(body, stops, 1.0, ShowRule(-1.0, 0.3))
    assert (cut.text, cut.token_ids, cut.logprobs) == ("foo(", [10, 11], [-0.1, -0.2])
    # Only the stop token is unsure: nothing to cut.
    assert generation_from_vllm(body, stops, 1.0, ShowRule(-3.0, 0.3)).text == "foo(bar)"
    # Unsure from the first token: no suggestion, no tokens to train on.
    none = generation_from_vllm(body, stops, 1.0, ShowRule(-0.05, 0.3))
    assert (none.text, none.token_ids) == ("", [])
    # vLLM's usage gives the prompt's tokens (the gateway's `usage`), kept through a cut; without it, unknown.
    counted = generation_from_vllm(body | {"usage": {"prompt_tokens": 42}}, stops, 1.0, ShowRule(-1.0, 0.3))
    assert (counted.prompt_tokens, cut.prompt_tokens) == (42, None)


def test_a_vllm_cut_that_splits_a_character_shows_nothing_and_missing_strings_are_named():
    body = _vllm_body(["é", "x"], [-0.1, -3.0], finish="length")
    body["choices"][0]["logprobs"]["tokens"] = ["bytes:\\xc3", "bytes:\\xa9x"]  # as vLLM spells half a character
    split = generation_from_vllm(body, ["<|endoftext|>"], 1.0, ShowRule(-1.0, 0.3))
    assert (split.text, split.token_ids) == ("", [])
    del body["choices"][0]["logprobs"]["tokens"]
    with pytest.raises(VllmError, match=r"logprobs\.tokens"):
        generation_from_vllm(body, ["<|endoftext|>"], 1.0, ShowRule(-1.0, 0.3))


def _serve_base(tmp_path, prompts, serving: dict) -> tuple[list, dict, str]:
    """POST prompts to a real gateway whose one arm is the shipped base: (answers, logged rows by id, /metrics)."""
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 12, **serving})
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm("champion", "base/1", str(BASE), "embedded", 1.0)])
    key = add_key(engine, "alice")
    with serve_app(create_app(params, engine=engine)) as url:
        answers = post_completions(url, key, prompts, max_tokens=12)
        metrics = httpx.get(f"{url}/metrics").text
    assert [a.status_code for a in answers] == [200] * len(answers), answers[0].text
    with engine.connect() as conn:
        rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
    engine.dispose()
    return answers, rows, metrics


def _row_shown(row, stop_ids: set[int]) -> tuple[bool, list[float]]:
    """(ended by a stop token, log-probs of the logged tokens that show text)."""
    ended_by_stop = bool(row["token_ids"]) and row["token_ids"][-1] in stop_ids
    return ended_by_stop, row["logprobs"][:-1] if ended_by_stop else row["logprobs"]


def test_the_gateway_shows_and_logs_only_the_sure_part(tmp_path, fim_samples, lm):
    answers, rows, _ = _serve_base(
        tmp_path, _prompts(lm, fim_samples), {"min_logprob": -1.0, "temperature": 0.7, "seed": 5}
    )
    stop_ids = set(lm.tokenizer.convert_tokens_to_ids(list(stops_of(lm.template, lm.tokenizer))))
    cut = 0
    for answer in answers:
        row = rows[answer.json()["id"]]
        assert answer.json()["choices"][0]["text"] == row["completion"]
        ended_by_stop, shown = _row_shown(row, stop_ids)
        assert all(lp >= -1.0 for lp in shown), row["logprobs"]  # logged at the serving temperature
        assert row["abstained"] == (row["completion"] == "")
        cut += not ended_by_stop and len(row["token_ids"]) < 12
    assert cut >= 1  # some suggestions were cut (not ended by the model, not at max_tokens)


def test_the_held_out_evaluation_applies_the_rule(typing_regions, lm):
    whole = type_regions(InProcess(lm), typing_regions, tiny_params(serving={"min_logprob": None}))
    silent = type_regions(InProcess(lm), typing_regions, tiny_params(serving={"min_logprob": 0.0}))
    sure = type_regions(InProcess(lm), typing_regions, tiny_params(serving={"min_logprob": -0.5}))
    assert whole.summary.shown > 0 and silent.summary.shown == 0
    assert sure.summary.shown < whole.summary.shown


def test_exploring_loosens_the_cut_and_needs_a_strict_rule_to_loosen():
    serving = ServingParams(min_logprob=-0.25, explore_fraction=0.2, explore_min_logprob=-1.0, temperature=0.3)
    assert show_rule(serving) == ShowRule(-0.25, 0.3)
    assert show_rule(serving, explore=True) == ShowRule(-1.0, 0.3)
    whole = ServingParams(min_logprob=-0.25, explore_fraction=0.2, explore_min_logprob=None, temperature=0.3)
    assert show_rule(whole, explore=True) is None
    with pytest.raises(ValueError, match="explore_fraction needs serving.min_logprob"):
        ServingParams(min_logprob=None, explore_fraction=0.2)
    with pytest.raises(ValueError, match=r"explore_min_logprob \(-0.1\) must be below min_logprob \(-0.25\)"):
        ServingParams(min_logprob=-0.25, explore_fraction=0.2, explore_min_logprob=-0.1)


def test_the_gateway_explores_a_fraction_of_requests_at_the_looser_cut(tmp_path, fim_samples, lm):
    serving = {
        "min_logprob": -0.05,
        "explore_fraction": 0.5,
        "explore_min_logprob": -3.0,
        "temperature": 0.7,
        "seed": 5,
    }
    answers, rows, metrics = _serve_base(tmp_path, _prompts(lm, fim_samples, n=16), serving)
    explored = int(float(re.search(r'tabrl_explored_total\{arm="champion",team="org"\} (\S+)', metrics).group(1)))
    assert 0 < explored < len(answers)  # seed 5's draws: some requests explore, some do not
    stop_ids = set(lm.tokenizer.convert_tokens_to_ids(list(stops_of(lm.template, lm.tokenizer))))
    loose = 0
    for row in rows.values():
        _, shown = _row_shown(row, stop_ids)
        assert all(lp >= -3.0 for lp in shown), row["logprobs"]  # never looser than the exploring cut
        loose += any(lp < -0.05 for lp in shown)  # shown past the strict cut: only an exploring request does
    assert 1 <= loose <= explored


def _log_softmax(logits: list[float], temperature: float) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    norm = top + math.log(sum(math.exp(x - top) for x in scaled))
    return [x - norm for x in scaled]


@pytest.mark.parametrize("temperature", [0.3, 1.7])
@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])  # flat to peaked distributions over 200 tokens
def test_a_greedy_rule_rescales_vllms_t1_logprobs_exactly_or_more_strictly(spread, temperature):
    """rule_logprobs: from T = 1 log-probs and the top-k, the chosen token's log-prob at the rule's temperature
    (below or above 1) is exact when the top-k covers the vocabulary and never above the exact one when it does
    not (the tail is bounded)."""
    rng = random.Random(int(spread * 10))
    for _ in range(20):
        logits = [rng.gauss(0.0, spread) for _ in range(200)]
        at_1, at_t = _log_softmax(logits, 1.0), _log_softmax(logits, temperature)
        order = sorted(range(200), key=lambda j: -at_1[j])
        best = order[0]
        full = rule_logprobs([at_1[best]], [{str(j): at_1[j] for j in order}], temperature, 200)[0]
        top20 = rule_logprobs([at_1[best]], [{str(j): at_1[j] for j in order[:20]}], temperature, 200)[0]
        assert full == pytest.approx(at_t[best], abs=1e-9)
        assert top20 <= at_t[best] + 1e-12
        if spread >= 3.0 and temperature < 1:  # a peaked distribution's tail is negligible at T = 0.3
            assert top20 == pytest.approx(at_t[best], abs=1e-3)
    assert rule_logprobs([-0.1, -2.0], [{"a": -0.1}, {"b": -2.0}], 1.0) == [-0.1, -2.0]  # vLLM's own at T = 1
    with pytest.raises(ValueError, match="vocabulary"):
        rule_logprobs([-0.1], [{"a": -0.1}], 1.7)  # above 1 the tail's bound needs the vocabulary's size
    with pytest.raises(ValueError, match="above 0"):
        rule_logprobs([-0.1], [{"a": -0.1}], 0.0)
