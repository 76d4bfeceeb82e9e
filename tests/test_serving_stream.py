"""Streamed completions (issue 58, item 1): the settled text as the model makes it (`tasks/core/streaming.py`), the
logged row exactly what the same request unstreamed logs."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from serving.auth import add_key
from serving.gateway import create_app
from tasks.core.fim import QWEN
from tasks.core.store import Arm, Store, completions, init_schema, replace_arms
from tasks.core.streaming import Holdback
from tests.conftest import tiny_params
from tests.serving_util import serve_app, streamed_chunks

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
    def start(**serving):
        params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "max_tokens": 40, **serving})
        engine = Store(params.paths.database_url).engine
        init_schema(engine)
        replace_arms(engine, [Arm("champion", "tiny/1", str(SHIPPED_BASE), "embedded", 1.0)])
        return engine, create_app(params, engine=engine)

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
