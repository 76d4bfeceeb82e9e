"""The gateway over real loopback HTTP (uvicorn in a thread), on SQLite and PostgreSQL, with the tiny model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from serving.auth import add_key, set_opt_out
from serving.gateway import create_app
from tasks.core.fim import QWEN
from tasks.core.store import Arm, Store, completions, feedback, init_schema, replace_arms
from tests.conftest import tiny_params
from tests.serving_util import serve_app

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
FIM = QWEN.render(PREFIX, SUFFIX)
# Continue's repo-level template for qwen...coder models.
REPO_FIM = (
    f"<|repo_name|>demo\n<|file_sep|>util.py\ndef helper():\n    return 1\n"
    f"<|file_sep|>main.py\n<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
)


@dataclass
class Gateway:
    url: str
    engine: sa.engine.Engine
    key: str  # key of user "alice"
    other_key: str  # key of user "bob"
    model_dir: str

    def post(self, path: str, body=None, key: str | None = "default", **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            headers["Authorization"] = f"Bearer {self.key if key == 'default' else key}"
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30, **kw)

    def rows(self, table) -> list[dict]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(table)).mappings()]


def _start(store_url, tmp_path, model_dir, auth=True, **serving):
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 8, "max_prompt_chars": 4000, **serving})
    engine = Store(store_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm("champion", "tiny/1", str(model_dir), "embedded", 1.0)])
    return params, engine, create_app(params, engine=engine, auth=auth)


@pytest.fixture
def gw(store_url, tmp_path, tiny_model_dir):
    params, engine, app = _start(store_url, tmp_path, tiny_model_dir)
    with serve_app(app) as url:
        yield Gateway(url, engine, add_key(engine, "alice"), add_key(engine, "bob"), str(tiny_model_dir))
    engine.dispose()


def _complete(gw: Gateway, **body) -> dict:
    response = gw.post("/v1/completions", {"prompt": FIM, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_row_is_committed_before_the_response(gw):
    answer = _complete(gw)  # no stop: defaults to the FIM/EOS stop strings
    rows = gw.rows(completions)
    assert [r["id"] for r in rows] == [answer["id"]]
    row = rows[0]
    assert row["user_id"] == "alice" and row["arm"] == "champion" and row["model_version"] == "tiny/1"
    assert (row["prefix"], row["suffix"], row["prompt"]) == (PREFIX, SUFFIX, FIM)
    assert row["completion"] == answer["choices"][0]["text"]
    assert len(row["token_ids"]) == len(row["logprobs"]) >= 1 and all(lp <= 0 for lp in row["logprobs"])
    assert row["abstained"] == (answer["choices"][0]["text"] == "")
    assert answer["object"] == "text_completion" and answer["tabrl"]["arm"] == "champion"


def test_repo_level_and_prompt_plus_suffix_forms(gw):
    repo = _complete(gw, prompt=REPO_FIM, stop=["<|endoftext|>", "<|file_sep|>"], max_tokens=4, top_p=0.9)
    split = _complete(gw, prompt=PREFIX, suffix=SUFFIX, stop="\n\n", user="ignored-with-auth")
    listed = _complete(gw, prompt=[FIM])
    by_id = {r["id"]: r for r in gw.rows(completions)}
    assert by_id[repo["id"]]["prompt"] == REPO_FIM  # the exact prompt the model saw
    assert (by_id[repo["id"]]["prefix"], by_id[repo["id"]]["suffix"]) == (PREFIX, SUFFIX)
    assert by_id[split["id"]]["prompt"] == FIM and by_id[split["id"]]["user_id"] == "alice"
    assert by_id[listed["id"]]["prompt"] == FIM
    assert len(by_id[repo["id"]]["token_ids"]) <= 4


def test_a_plain_openai_prompt_is_a_prefix_with_an_empty_suffix(gw):
    plain = _complete(gw, prompt=PREFIX)  # no FIM marker, no suffix: what any OpenAI completions client sends
    row = {r["id"]: r for r in gw.rows(completions)}[plain["id"]]
    assert (row["prefix"], row["suffix"]) == (PREFIX, "")
    assert row["prompt"] == QWEN.render(PREFIX, "")  # rendered in the arm's own template


def test_streaming_sends_sse_chunks_and_done(gw):
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        json={"prompt": FIM, "stream": True, "temperature": 0},
        headers={"Authorization": f"Bearer {gw.key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    row = gw.rows(completions)[0]
    assert row["id"] in ids and row["completion"] == text


def test_the_official_openai_client_gets_full_usage_streamed_or_not(gw):
    """Issue 58, item 1 (usage): the `openai` package's completions.create, plain and with stream=True and
    stream_options.include_usage, gets OpenAI's usage: the prompt's tokens as the model read them, the
    completion's as logged, and their sum; the streamed usage comes last, in a chunk with no choices."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0)
    plain = client.completions.create(model="tiny/1", prompt=FIM, max_tokens=8, temperature=0)
    row = {r["id"]: r for r in gw.rows(completions)}[plain.id]
    prompt_tokens = len(AutoTokenizer.from_pretrained(gw.model_dir)(FIM, add_special_tokens=False)["input_ids"])
    assert plain.usage.prompt_tokens == prompt_tokens
    assert plain.usage.completion_tokens == len(row["token_ids"])
    assert plain.usage.total_tokens == prompt_tokens + len(row["token_ids"])

    chunks = list(
        client.completions.create(
            model="tiny/1", prompt=FIM, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    *text_chunks, last = chunks
    assert last.choices == [] and all(c.usage is None for c in text_chunks)
    streamed = {r["id"]: r for r in gw.rows(completions)}[last.id]
    assert "".join(c.choices[0].text for c in text_chunks) == streamed["completion"]
    assert last.usage.prompt_tokens == prompt_tokens
    assert last.usage.total_tokens == prompt_tokens + len(streamed["token_ids"])
    without = list(client.completions.create(model="tiny/1", prompt=FIM, max_tokens=8, temperature=0, stream=True))
    assert all(c.choices for c in without)  # no usage chunk unless asked for


# What Continue's vllm/openai provider posted for an autocomplete (STACK-NOTES.md: the FIM prompt built by Continue,
# streamed, its stop list), with the neutral values a client may add.
CONTINUE_BODY = {
    "model": "qwen2.5-coder-tabrl",
    "prompt": FIM,
    "max_tokens": 8,
    "temperature": 0.01,
    "stop": ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|file_sep|>"],
    "stream": True,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "echo": False,
}


def test_parameters_that_would_change_the_answer_are_refused_naming_them(gw):
    """Issue 58, item 1: echo, best_of, logprobs, penalties and logit_bias are not served: at OpenAI's neutral
    value they pass (a recorded Continue body, the openai client's defaults), at any other the answer is 400 naming
    them, and nothing is logged."""
    from openai import BadRequestError, OpenAI

    before = len(gw.rows(completions))
    continued = gw.post("/v1/completions", CONTINUE_BODY)
    assert continued.status_code == 200 and continued.text.startswith("data: "), continued.text
    client = OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0)
    assert client.completions.create(model="tiny/1", prompt=FIM, max_tokens=4).choices
    for extra, named in (
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 1}, "logprobs"),
        ({"presence_penalty": 0.5, "logprobs": 2}, "logprobs, presence_penalty"),
        ({"logit_bias": {"50": 100}}, "logit_bias"),
    ):
        refused = gw.post("/v1/completions", {"prompt": FIM, **extra})
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
    try:
        client.completions.create(model="tiny/1", prompt=FIM, max_tokens=4, echo=True)
        raise AssertionError("echo=True was served")
    except BadRequestError as err:
        assert "echo" in str(err)
    assert len(gw.rows(completions)) == before + 2  # the two served, none of the refused
    cards = client.models.list().data
    assert [c.id for c in cards] == ["tiny/1"] and cards[0].owned_by == "tabrl" and cards[0].created > 1.7e9


def test_a_seed_gives_the_same_suggestion_again(gw):
    """OpenAI's `seed` is served: the same request with the same seed gets the same suggestion and log-probs, whatever
    was drawn in between; other seeds draw others; a seed outside 0..2**63-1 is refused naming it."""
    body = {"prompt": FIM, "max_tokens": 8, "temperature": 1.0}
    first = gw.post("/v1/completions", body | {"seed": 7})
    assert first.status_code == 200, first.text
    for _ in range(3):  # unseeded draws from the gateway's own generator between the two
        assert gw.post("/v1/completions", body).status_code == 200
    again = gw.post("/v1/completions", body | {"seed": 7})
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    logged = {r["id"]: r for r in gw.rows(completions)}
    a, b = logged[first.json()["id"]], logged[again.json()["id"]]
    assert (a["token_ids"], a["logprobs"]) == (b["token_ids"], b["logprobs"])
    others = {gw.post("/v1/completions", body | {"seed": s}).json()["choices"][0]["text"] for s in range(8)}
    assert len(others) > 1
    refused = gw.post("/v1/completions", body | {"seed": -1})
    assert refused.status_code == 422 and "seed" in refused.text, refused.text


def test_feedback_is_idempotent_first_answer_wins(gw):
    cid = _complete(gw)["id"]
    first = gw.post("/v1/feedback", {"completion_id": cid, "accepted": True, "accepted_chars": 3})
    assert first.status_code == 200 and first.json()["duplicate"] is False
    again = gw.post("/v1/feedback", {"completion_id": cid, "accepted": True})
    assert again.status_code == 200 and again.json()["duplicate"] is True
    flip = gw.post("/v1/feedback", {"completion_id": cid, "accepted": False})
    assert flip.status_code == 409 and "first answer wins" in flip.json()["error"]["message"]
    rows = gw.rows(feedback)
    assert len(rows) == 1 and rows[0]["accepted"] is True and rows[0]["accepted_chars"] == 3
    assert rows[0]["matched"] is True and rows[0]["source"] == "api" and rows[0]["user_id"] == "alice"


def test_auth_keys_and_cross_user_feedback(gw):
    assert gw.post("/v1/completions", {"prompt": FIM}, key=None).status_code == 401
    bad = gw.post("/v1/completions", {"prompt": FIM}, key="tabrl-not-a-key")
    assert bad.status_code == 401 and "API key" in bad.json()["error"]["message"]
    cid = _complete(gw)["id"]
    stolen = gw.post("/v1/feedback", {"completion_id": cid, "accepted": True}, key=gw.other_key)
    assert stolen.status_code == 403 and "another user" in stolen.json()["error"]["message"]
    assert gw.rows(feedback) == []  # the rejected answer left nothing behind
    assert gw.post("/v1/feedback", {"completion_id": cid, "accepted": False}).status_code == 200


def test_opted_out_users_are_served_not_logged(gw):
    set_opt_out(gw.engine, "bob", True)
    answer = gw.post("/v1/completions", {"prompt": FIM}, key=gw.other_key)
    assert answer.status_code == 200 and answer.json()["tabrl"]["logged"] is False
    header = gw.post("/v1/completions", {"prompt": FIM}, headers={"X-Tabrl-Opt-Out": "1"})
    assert header.status_code == 200 and header.json()["choices"][0]["text"] is not None
    fb = gw.post("/v1/feedback", {"completion_id": answer.json()["id"], "accepted": True}, key=gw.other_key)
    assert fb.status_code == 200 and fb.json() == {"logged": False}
    assert gw.rows(completions) == [] and gw.rows(feedback) == []
    _complete(gw)  # alice is still logged
    assert len(gw.rows(completions)) == 1


BAD_INPUTS = [
    ("/v1/completions", b"{not json", 422, "malformed JSON"),
    ("/v1/completions", {"max_tokens": 4}, 422, "prompt"),
    ("/v1/completions", {"prompt": "<|fim_prefix|>def f():"}, 400, "no <|fim_suffix|>"),
    ("/v1/completions", {"prompt": "x" * 5000, "suffix": ""}, 413, "prompt is 5000 characters"),
    ("/v1/completions", {"prompt": FIM, "temperature": -1}, 422, "temperature"),
    ("/v1/completions", {"prompt": [FIM, FIM]}, 422, "one prompt per request"),
    ("/v1/completions", {"prompt": FIM, "stop": ["x"] * 40}, 422, "stop"),
    ("/v1/completions", {"prompt": FIM, "n": 3}, 422, "n:"),
    ("/v1/feedback", {"completion_id": "cmpl-nope", "accepted": True}, 404, "unknown completion id"),
    ("/v1/feedback", {"completion_id": "cmpl-nope", "accepted": "yes"}, 422, "accepted"),
    ("/v1/feedback", {"accepted": True}, 422, "completion_id"),
    ("/v1/feedback", {"completion_id": "c", "accepted": True, "accepted_chars": -1}, 422, "accepted_chars"),
    ("/api/training/submit", [1, 2], 422, "JSON object"),
    ("/api/training/submit", {"completionId": "x"}, 422, "accepted"),
    ("/api/training/submit", {"accepted": True, "completion": "y" * 9000}, 413, "completion"),
    ("/api/continue/events", {"name": "autocomplete", "data": {}, "schema": "0.1.0"}, 422, "schema"),
    ("/api/continue/events", {"name": "autocomplete", "schema": "0.2.0"}, 422, "data"),
    (
        "/api/continue/events",
        {"name": "autocomplete", "data": {"accepted": "no"}, "schema": "0.2.0"},
        422,
        "data.accepted",
    ),
    ("/api/continue/events", {"name": "autocomplete", "data": {}, "schema": "0.2.0", "level": "some"}, 422, "level"),
]


def test_bad_input_is_a_4xx_naming_the_problem(gw):
    for path, body, status, needle in BAD_INPUTS:
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {}
        response = gw.post(path, None if isinstance(body, bytes) else body, **kw)
        assert response.status_code == status, (path, body, response.text)
        assert needle in response.json()["error"]["message"], (path, body, response.text)
    assert gw.rows(completions) == [] and gw.rows(feedback) == []  # nothing stored, nothing corrupted


def test_unknown_arm_and_backend_errors(gw):
    unknown = gw.post("/v1/completions", {"prompt": FIM}, headers={"X-Tabrl-Arm": "nope"})
    assert unknown.status_code == 404 and "unknown arm 'nope'" in unknown.json()["error"]["message"]
    replace_arms(gw.engine, [Arm("champion", "broken/1", "/nonexistent/model", "embedded", 1.0)])
    broken = gw.post("/v1/completions", {"prompt": FIM})
    assert broken.status_code == 502 and "arm 'champion'" in broken.json()["error"]["message"]
    assert gw.rows(completions) == []


def test_fallback_to_champion_and_share_changes_without_restart(gw):
    replace_arms(
        gw.engine,
        [
            Arm("champion", "tiny/1", gw.model_dir, "embedded", 0.0),
            Arm("challenger", "dead/2", "http://127.0.0.1:9/v1", "vllm", 1.0),
        ],
    )
    answer = _complete(gw)
    assert answer["tabrl"]["arm"] == "champion"  # the challenger's vLLM is down: the champion answered
    assert gw.rows(completions)[0]["arm"] == "champion"
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'tabrl_fallbacks_total{arm="challenger",team="org"} 1.0' in metrics
    replace_arms(
        gw.engine,
        [
            Arm("champion", "tiny/1", gw.model_dir, "embedded", 0.0),
            Arm("challenger", "tiny/2", gw.model_dir, "embedded", 1.0),
        ],
    )
    assert _complete(gw)["tabrl"]["arm"] == "challenger"  # new shares without a restart (ttl 0)
    pinned = gw.post("/v1/completions", {"prompt": FIM}, headers={"X-Tabrl-Arm": "champion"})
    assert pinned.json()["tabrl"]["arm"] == "champion"


def test_rlinf_and_continue_outcomes_match_by_prompt_hash(gw):
    answer = _complete(gw)
    text = answer["choices"][0]["text"]
    rlinf = gw.post(
        "/api/training/submit",
        {
            "completionId": "rlinf-uuid-1",
            "prefix": PREFIX,
            "suffix": SUFFIX,
            "prompt": FIM,
            "completion": text,
            "accepted": True,
            "time": 123,
            "modelName": "tabrl",
        },
    )
    assert rlinf.status_code == 200 and rlinf.json()["matched"] is True
    assert rlinf.json()["completion_id"] == answer["id"]
    other = _complete(gw, prompt=REPO_FIM)
    event = {
        "name": "autocomplete",
        "schema": "0.2.0",
        "level": "all",
        "profileId": "local",
        "data": {
            "accepted": False,
            "time": 85,
            "prefix": PREFIX,
            "suffix": SUFFIX,
            "prompt": REPO_FIM,
            "completion": other["choices"][0]["text"],
            "modelProvider": "vllm",
            "modelName": "qwen2.5-coder",
            "completionId": "continue-uuid-1",
            "cacheHit": False,
            "filepath": "main.py",
        },
    }
    matched = gw.post("/api/continue/events", event)
    assert matched.status_code == 200 and matched.json()["completion_id"] == other["id"]
    unmatched = gw.post(
        "/api/continue/events",
        {**event, "data": {**event["data"], "completion": "zzz", "completionId": "continue-uuid-2"}},
    )
    assert unmatched.json()["matched"] is False and unmatched.json()["completion_id"] == "continue-uuid-2"
    no_code = gw.post(
        "/api/continue/events",
        {
            **event,
            "level": "noCode",
            "data": {"accepted": True, "time": 40, "completionId": "continue-uuid-3", "modelName": "qwen2.5-coder"},
        },
    )
    assert no_code.status_code == 200 and no_code.json()["matched"] is False
    ignored = gw.post("/api/continue/events", {**event, "name": "chatInteraction"})
    assert ignored.status_code == 200 and ignored.json()["ignored"] is True
    rows = {r["completion_id"]: r for r in gw.rows(feedback)}
    assert set(rows) == {answer["id"], other["id"], "continue-uuid-2", "continue-uuid-3"}
    assert rows[answer["id"]]["source"] == "rlinf" and rows[answer["id"]]["accepted"] is True
    assert rows[other["id"]]["source"] == "continue" and rows[other["id"]]["payload"] is None
    assert rows["continue-uuid-2"]["payload"]["completion"] == "zzz"
    assert rows["continue-uuid-3"]["trainable"] is False and "prompt" not in rows["continue-uuid-3"]["payload"]
    # bob cannot claim alice's completion through the hash either: his outcome stays unmatched
    bob = gw.post(
        "/api/training/submit",
        {"prompt": FIM, "completion": text, "accepted": True, "completionId": "bob-1"},
        key=gw.other_key,
    )
    assert bob.json()["matched"] is False


def test_models_healthz_metrics(gw):
    models = httpx.get(gw.url + "/v1/models").json()
    assert [m["arm"] for m in models["data"]] == ["champion"] and models["data"][0]["id"] == "tiny/1"
    health = httpx.get(gw.url + "/healthz")
    assert health.status_code == 200 and health.json()["arms"] == ["champion"]
    shown = [a for a in (_complete(gw) for _ in range(3))]
    for answer in shown:
        gw.post("/v1/feedback", {"completion_id": answer["id"], "accepted": True})
    metrics = httpx.get(gw.url + "/metrics").text
    n_shown = sum(1 for a in shown if a["choices"][0]["text"])
    assert 'tabrl_requests_total{endpoint="/v1/completions",status="200"} 3.0' in metrics
    assert 'tabrl_completion_latency_seconds_count{arm="champion",team="org"} 3.0' in metrics
    if n_shown:
        assert 'tabrl_online_accept_rate{arm="champion",team="org"} 1.0' in metrics


def _samples(metrics_text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one metric on a /metrics page, by their sorted labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == name
    }


def test_metrics_show_each_arms_latency_p50_and_p95(gw):
    replace_arms(
        gw.engine,
        [
            Arm("champion", "tiny/1", gw.model_dir, "embedded", 0.5),
            Arm("challenger", "tiny/2", gw.model_dir, "embedded", 0.5),
        ],
    )
    for arm in ("champion", "challenger", "champion", "challenger", "champion"):
        pinned = gw.post("/v1/completions", {"prompt": FIM, "temperature": 0}, headers={"X-Tabrl-Arm": arm})
        assert pinned.status_code == 200 and pinned.json()["tabrl"]["arm"] == arm
    text = httpx.get(gw.url + "/metrics").text
    gauges = _samples(text, "tabrl_arm_latency_ms")
    totals = _samples(text, "tabrl_completion_latency_seconds_sum")  # the histogram stays
    for arm in ("champion", "challenger"):
        p50 = gauges[(("arm", arm), ("quantile", "0.5"), ("team", "org"))]
        p95 = gauges[(("arm", arm), ("quantile", "0.95"), ("team", "org"))]
        # every latency is > 0 and at most the arm's total, so its quantiles are too
        assert 0 < p50 <= p95 <= totals[(("arm", arm), ("team", "org"))] * 1000
    assert len(gauges) == 4


def test_no_auth_mode_uses_the_user_field_and_rate_limit(store_url, tmp_path, tiny_model_dir):
    params, engine, app = _start(store_url, tmp_path, tiny_model_dir, auth=False, rate_limit_per_minute=2)
    with serve_app(app) as url:
        first = httpx.post(url + "/v1/completions", json={"prompt": FIM, "user": "carol"}, timeout=30)
        second = httpx.post(url + "/v1/completions", json={"prompt": FIM, "user": "carol"}, timeout=30)
        third = httpx.post(url + "/v1/completions", json={"prompt": FIM, "user": "carol"}, timeout=30)
        assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
        assert "rate limit" in third.json()["error"]["message"]
        other = httpx.post(url + "/v1/completions", json={"prompt": FIM, "user": "dave"}, timeout=30)
        assert other.status_code == 200
        fb = httpx.post(url + "/v1/feedback", json={"completion_id": first.json()["id"], "accepted": True}, timeout=30)
        assert fb.status_code == 200
    with engine.connect() as conn:
        users = sorted(conn.execute(sa.select(completions.c.user_id)).scalars())
    assert users == ["carol", "carol", "dave"]
    engine.dispose()


def test_serving_seed_makes_sampling_repeatable(tmp_path, tiny_model_dir):
    """Two gateways started with the same serving.seed sample the same completions for the same requests."""
    runs = []
    for i in range(2):
        _, engine, app = _start(
            f"sqlite:///{tmp_path}/seed{i}.db",
            tmp_path / f"g{i}",
            tiny_model_dir,
            auth=False,
            seed=1234,
            temperature=1.0,
        )
        with serve_app(app) as url:
            body = {"prompt": FIM, "user": "u1", "max_tokens": 8}
            runs.append(
                [
                    httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
                    for _ in range(4)
                ]
            )
        engine.dispose()
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1, "temperature 1.0 should not give one completion four times"
