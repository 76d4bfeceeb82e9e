"""The gateway's pure pieces, without a server: request normalisation, the rate limiter, the caller."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.auth import Caller, Directory, add_key, resolve_caller, set_opt_out
from serving.errors import ApiError
from serving.limits import RateLimiter
from serving.metrics import Metrics
from serving.normalise import normalise_request
from serving.protocol import CompletionRequest
from serving.router import FimRequest, stops_for
from tasks.core.config import ServingParams
from tasks.core.fim import CODELLAMA, CODESTRAL, DEEPSEEK, PREFIX_ONLY, QWEN, STARCODER, FimPrompt
from tasks.core.store import Arm, Store, init_schema

SERVING = ServingParams(max_tokens=48, temperature=0.7, max_prompt_chars=100)


def test_a_fim_prompt_is_parsed_and_sampling_follows_the_server():
    prompt = QWEN.render("def f(", "):\n")
    inputs = normalise_request(CompletionRequest(prompt=prompt, max_tokens=500), SERVING)
    req = inputs.request
    assert (req.fim, req.source, inputs.client_prompt) == (FimPrompt("def f(", "):\n"), QWEN, prompt)
    assert req.max_tokens == 48  # capped at serving.max_tokens
    assert req.temperature == 0.7 and req.stop is None  # no stop: the serving model's own


def test_prefix_and_suffix_are_taken_as_they_are_and_a_one_element_list_is_one_prompt():
    inputs = normalise_request(
        CompletionRequest(prompt=["x = "], suffix="\n", temperature=0.0, stop="\n", max_tokens=4), SERVING
    )
    req = inputs.request
    assert req.fim == FimPrompt("x = ", "\n") and req.source is None
    assert inputs.client_prompt == QWEN.render("x = ", "\n")  # the key outcomes sent as prefix + suffix match on
    assert req.temperature == 0.0 and req.stop == ["\n"] and req.max_tokens == 4


@pytest.mark.parametrize("template", [QWEN, STARCODER, DEEPSEEK, CODELLAMA, CODESTRAL])
def test_every_fim_template_continue_sends_is_understood(template):
    inputs = normalise_request(CompletionRequest(prompt=template.render("a = ", "\nb")), SERVING)
    assert inputs.request.source == template and inputs.request.fim == FimPrompt("a = ", "\nb")


def test_stops_follow_the_serving_model_when_families_differ():
    req = FimRequest(FimPrompt("a", "b"), QWEN, [*QWEN.stops[:2], "\n\n"], 8, 0.0, 1.0)
    assert stops_for(QWEN, req) == req.stop  # same family: the editor's list as sent
    assert stops_for(STARCODER, req) == [*STARCODER.stops, "\n\n"]  # Qwen's markers swapped for StarCoder's
    assert stops_for(PREFIX_ONLY, FimRequest(FimPrompt("a", "b"), None, None, 8, 0.0, 1.0)) == ["\n"]


@pytest.mark.parametrize(
    "request_, status, param",
    [
        (CompletionRequest(prompt=["a", "b"]), 422, "prompt"),
        (CompletionRequest(prompt="<|fim_prefix|>a FIM prompt cut short"), 400, "prompt"),
        (CompletionRequest(prompt="x" * 101, suffix=""), 413, "prompt"),
        (CompletionRequest(prompt="x", suffix="y" * 101), 413, "suffix"),
        (CompletionRequest(prompt="x", suffix="", stop=[str(i) for i in range(33)]), 422, "stop"),
    ],
)
def test_bad_requests_name_the_field(request_, status, param):
    with pytest.raises(ApiError) as err:
        normalise_request(request_, SERVING)
    assert (err.value.status, err.value.param) == (status, param) and err.value.message


def test_rate_limits_per_user_and_per_key_with_retry_after():
    limiter = RateLimiter(per_user=2, per_key=3, max_windows=100)
    alice, alice_key = Caller("alice", True, False), Caller("alice", True, True, key_hash="k1")
    limiter.check(alice, now=0.0)
    limiter.check(alice, now=1.0)
    with pytest.raises(ApiError) as err:
        limiter.check(alice, now=10.0)
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "51"} and "per user" in err.value.message
    limiter.check(Caller("bob", True, False), now=10.0)  # another user has a window of their own
    limiter.check(alice, now=61.0)  # a new minute
    limiter2 = RateLimiter(per_user=100, per_key=1, max_windows=100)
    limiter2.check(alice_key, now=0.0)
    with pytest.raises(ApiError, match="per API key"):
        limiter2.check(Caller("carol", True, True, key_hash="k1"), now=1.0)  # the same key, another user


def test_finished_windows_are_forgotten_past_the_cap():
    limiter = RateLimiter(per_user=1, per_key=1, max_windows=2)
    for i in range(3):
        limiter.check(Caller(f"u{i}", True, False), now=0.0)
    limiter.check(Caller("late", True, False), now=120.0)
    assert len(limiter._windows) == 1  # the three finished windows went, the new one stays


def test_the_caller_is_the_keys_user_with_auth_and_the_claimed_user_without(tmp_path):
    engine = Store(f"sqlite:///{tmp_path}/store.db").engine
    init_schema(engine)
    key = add_key(engine, "dana")
    set_opt_out(engine, "erin", True)
    directory = Directory(engine, ttl_s=60)

    def caller(headers, claimed=None, auth=True):
        return asyncio.run(resolve_caller(headers, claimed, directory, auth))

    dana = caller({"authorization": f"Bearer {key}"})
    assert (dana.user_id, dana.logged, dana.owner_checked) == ("dana", True, True) and dana.key_hash
    for headers in ({}, {"authorization": "Basic abc"}, {"authorization": "Bearer nope"}):
        with pytest.raises(ApiError) as err:
            caller(headers)
        assert err.value.status == 401
    assert caller({}, "erin", auth=False) == Caller("erin", False, False)  # opted out: served, never logged
    assert caller({"x-tabrl-user": "fay", "x-tabrl-opt-out": "1"}, auth=False) == Caller("fay", False, False)
    assert caller({}, auth=False).user_id == "anonymous"


def test_latency_gauges_are_the_quantiles_of_each_arms_latest_window():
    metrics = Metrics(latency_window=4)
    champion, challenger = (Arm(name, "m/1", "/m", "embedded", 0.5) for name in ("champion", "challenger"))
    for ms in (900.0, 10.0, 20.0, 30.0, 40.0):  # the first falls out of the window of 4
        metrics.served(champion, True, ms / 1000)
    metrics.served(challenger, False, 0.005)
    metrics.served(Arm("champion", "m.alpha/2", "/m", "embedded", 1.0, team="alpha"), True, 0.5)  # a team's own
    gauges = {
        (s.labels["arm"], s.labels["quantile"]): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name == "tabrl_arm_latency_ms" and s.labels["team"] == "org"
    }
    assert gauges[("champion", "0.5")] == pytest.approx(25.0)
    assert gauges[("champion", "0.95")] == pytest.approx(np.quantile([10, 20, 30, 40], 0.95))  # 38.5
    assert gauges[("challenger", "0.5")] == gauges[("challenger", "0.95")] == pytest.approx(5.0)
    teams = {
        (s.labels["team"], s.labels["arm"]): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name == "tabrl_arm_latency_ms" and s.labels["quantile"] == "0.5"
    }
    assert teams == {("org", "champion"): 25.0, ("org", "challenger"): 5.0, ("alpha", "champion"): 500.0}
