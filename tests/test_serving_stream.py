"""Streamed completions (issue 58, item 1): the settled text as the model makes it (`tasks/core/streaming.py`), the
logged row exactly what the same request unstreamed logs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from serving.auth import add_key
from serving.gateway import create_app
from tasks.core.fim import QWEN
from tasks.core.store import CHAMPION, Arm, Store, completions, init_schema, replace_arms
from tasks.core.streaming import Holdback
from tests.conftest import tiny_params
from tests.serving_util import serve_app, streamed_chunks
from tests.support.harness import delayed_factory

STOPS = ("\n\n", "<|endoftext|>")


def _released(stops, steps) -> list[str]:
    """What a Holdback releases as each (decoded text so far, newest token sure) step comes."""
    holdback = Holdback(stops)
    return [holdback.release(text, sure) for text, sure in steps]


def test_holdback_releases_only_text_no_stop_string_or_unsure_token_can_take_back():
    # an end that may begin a stop string waits ("\n" may become "\n\n", "<|end" may become "<|endoftext|>")
    grow = ["  x", "  x = 1", "  x = 1\n", "  x = 1\ny", "  x = 1\ny<|end", "  x = 1\ny<|end\n\nz"]
    released = _released(STOPS, [(t, True) for t in grow])
    assert released == ["  x", " = 1", "", "\ny", "", "<|end"]  # the stop string came: up to it, never past
    # blank so far: nothing, since a blank suggestion is not shown
    assert _released(STOPS, [("   ", True), ("   \n ", True)]) == ["", ""]
    # an unsure token ends the suggestion before it: what is settled goes, nothing after
    steps = [("ab", True), ("abcdefghijklmnop", True), ("abcdefghijklmnop", False), ("abcdefghijklmnopqrs", True)]
    assert "".join(_released(("<|endoftext|>",), steps)) == "abcdefghijklmnop"
    # half a character (a token cut in a UTF-8 sequence decodes to U+FFFD) waits for the rest of it
    assert _released((), [("é\ufffd", True), ("éè", True)]) == ["é", "è"]


PROMPTS = [
    QWEN.render("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"),
    QWEN.render("import os\n\ndef list_files(path):\n    ", "\n"),
    QWEN.render("class Point:\n    def __init__(self, x, y):\n        ", "\n\n    def norm(self):\n"),
    QWEN.render("for i in range(10):\n    ", ""),
]


SHIPPED_BASE = Path(__file__).resolve().parents[1] / "models" / "tabrl-tiny"  # writes code, unlike the test's


@pytest.fixture
def gateway(tmp_path):
    def start(factory=None, **serving):
        params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 40, **serving})
        engine = Store(params.paths.database_url).engine
        init_schema(engine)
        replace_arms(engine, [Arm(CHAMPION, "tiny/1", str(SHIPPED_BASE), "embedded", 1.0)])
        return engine, create_app(params, engine=engine, **({} if factory is None else {"backend_factory": factory}))

    return start


LOGGED = ("completion", "token_ids", "logprobs", "abstained", "prompt", "model_version")


@pytest.mark.parametrize("min_logprob", [None, -1.0], ids=["no-show-rule", "show-rule"])
def test_a_streamed_answer_comes_in_pieces_and_logs_the_row_it_logs_unstreamed(gateway, min_logprob):
    """The tiny model at temperature 0 (deterministic): each prompt asked streamed and unstreamed. The streamed
    answer's pieces make the logged suggestion, its first piece carries the tabrl block, and with no show rule
    some answer arrives in more than one piece (unstreamed text comes in one, at the end); the two rows agree in
    everything the model made. Under a show rule the pieces stop where the rule cuts."""
    engine, app = gateway(min_logprob=min_logprob)
    key = add_key(engine, "alice")
    pieces_per_answer = []
    with serve_app(app) as url:
        for prompt in PROMPTS:
            chunks = streamed_chunks(url, key, prompt, temperature=0, max_tokens=40)
            plain = httpx.post(
                url + "/v1/completions",
                json={"prompt": prompt, "temperature": 0, "max_tokens": 40},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            ).json()
            with engine.connect() as conn:
                rows = {r["id"]: r for r in conn.execute(sa.select(completions)).mappings()}
            streamed_row, plain_row = rows[chunks[0]["id"]], rows[plain["id"]]
            *texts, finish = chunks
            assert (
                finish["choices"][0]["finish_reason"] in ("stop", "length") and chunks[0]["tabrl"]["arm"] == "champion"
            )
            assert "".join(c["choices"][0]["text"] for c in texts) == streamed_row["completion"]
            assert {k: streamed_row[k] for k in LOGGED} == {k: plain_row[k] for k in LOGGED}
            assert plain["choices"][0]["text"] == plain_row["completion"]
            pieces_per_answer.append(sum(1 for c in texts if c["choices"][0]["text"]))
    if min_logprob is None:
        assert max(pieces_per_answer) >= 2, pieces_per_answer


def test_a_client_that_hangs_up_mid_stream_is_logged_cancelled(gateway):
    """The row is committed before the stream's last chunk; a client that read a piece and hung up before it is a
    cancel (docs/concepts/outcomes.md). The arm's answer is held 10 s after generation (a slow network, say), and the
    client hangs up 3 s after its first piece, when the model has finished and the last chunk has not come: the row
    keeps the suggestion the model made, stamped cancelled. (A hang-up during generation stops it, as unstreamed.)"""
    engine, app = gateway(factory=delayed_factory({CHAMPION: 10.0}), min_logprob=None)
    key = add_key(engine, "alice")
    body = {"prompt": PROMPTS[1], "stream": True, "temperature": 0, "max_tokens": 40}
    with serve_app(app) as url:
        started = time.perf_counter()
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as response:
            lines = response.iter_lines()  # held: an iterator dropped here would close the connection at once
            first = json.loads(next(line for line in lines if line).removeprefix("data: "))
            read_s = time.perf_counter() - started
            time.sleep(3.0)  # the model has finished (tabrl-tiny: milliseconds, seconds on a slow busy CPU); held
        # leaving the block closes the connection: the hang-up
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _rows(engine):
            time.sleep(0.1)
    (row,) = _rows(engine)
    assert read_s < 6.0 and first["choices"][0]["text"]  # a piece came long before the held answer
    assert row["cancelled_at"] is not None and row["token_ids"]
    assert row["completion"].startswith(first["choices"][0]["text"])


def _rows(engine) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(completions)).mappings()]
