"""The gateway's pure pieces, without a server: request normalisation, the rate limiter, the caller."""

from __future__ import annotations

import asyncio

import pytest

from serving.auth import Caller, Directory, RateLimiter, add_key, resolve_caller, set_opt_out
from serving.errors import ApiError
from serving.gateway import CompletionRequest, normalise_request
from serving.store import init_schema, make_engine
from tasks.config import ServingParams
from tasks.fim import STOP_STRINGS, build_prompt

SERVING = ServingParams(max_tokens=48, temperature=0.7, max_prompt_chars=100)


def test_a_fim_prompt_is_parsed_and_sampling_follows_the_server():
    inputs = normalise_request(CompletionRequest(prompt=build_prompt("def f(", "):\n"), max_tokens=500), SERVING)
    assert (inputs.prefix, inputs.suffix, inputs.prompt) == ("def f(", "):\n", build_prompt("def f(", "):\n"))
    assert inputs.max_tokens == 48  # capped at serving.max_tokens
    assert inputs.temperature == 0.7 and inputs.stop == list(STOP_STRINGS)


def test_prefix_and_suffix_become_a_fim_prompt_and_a_one_element_list_is_one_prompt():
    inputs = normalise_request(
        CompletionRequest(prompt=["x = "], suffix="\n", temperature=0.0, stop="\n", max_tokens=4), SERVING
    )
    assert inputs.prompt == build_prompt("x = ", "\n") and inputs.prefix == "x = " and inputs.suffix == "\n"
    assert inputs.temperature == 0.0 and inputs.stop == ["\n"] and inputs.max_tokens == 4


@pytest.mark.parametrize(
    "request_, status, param",
    [
        (CompletionRequest(prompt=["a", "b"]), 422, "prompt"),
        (CompletionRequest(prompt="no fim markers here"), 422, "prompt"),
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
    engine = make_engine(f"sqlite:///{tmp_path}/store.db")
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
