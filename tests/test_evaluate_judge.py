"""The LLM judge against a real HTTP server on loopback speaking OpenAI chat completions."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tasks.core.config import JudgeParams
from tasks.evaluate.judge import (
    JudgeCache,
    JudgeError,
    JudgeUnavailable,
    Verdict,
    judge,
    judge_prompt,
    llm_judge,
    parse_verdict,
    reference_judge,
)

KEY_ENV = "TABRL_TEST_JUDGE_KEY"


def answer(score, why="fits the context") -> str:
    return f"<evaluation>\n<score>{score}</score>\n<justification>{why}</justification>\n</evaluation>"


class FakeJudge:
    """A chat-completions endpoint whose answer depends on the completion under review.

    The completion text picks the behaviour: ``score:N`` answers level N; ``malformed`` answers
    prose without the XML block; ``ratelimit-once`` gets a 429 on its first request; ``slow-once``
    sleeps past the client's timeout on its first request; ``slow-always`` on every request.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.seen: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0
        self.status_always: int | None = None
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                    prompt = body["messages"][0]["content"]
                    completion = re.search(r"<completion>\n(.*)\n</completion>", prompt, re.DOTALL).group(1)
                    fake.seen[completion] = attempt = fake.seen.get(completion, 0) + 1
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    self._answer(body, completion, attempt)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and hung up: that is the point of the test
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _answer(self, body, completion, attempt):
                time.sleep(fake.delay_s)
                if fake.status_always is not None:
                    return self._send(fake.status_always, {"error": {"message": "nope", "type": "test"}})
                if completion == "ratelimit-once" and attempt == 1:
                    return self._send(
                        429, {"error": {"message": "slow down", "type": "rate_limit"}}, {"retry-after-ms": "20"}
                    )
                if completion == "slow-always" or (completion == "slow-once" and attempt == 1):
                    time.sleep(1.5)
                if completion == "malformed":
                    content = "I would give this an 8 out of 10."
                else:
                    match = re.fullmatch(r"score:(\d+)", completion)
                    content = answer(match.group(1) if match else 8)
                self._send(
                    200,
                    {
                        "id": f"chatcmpl-{len(fake.requests)}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                    },
                )

            def _send(self, status, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def completions_sent(self) -> list[str]:
        return [
            re.search(r"<completion>\n(.*)\n</completion>", r["body"]["messages"][0]["content"], re.DOTALL).group(1)
            for r in self.requests
        ]


@pytest.fixture
def fake_judge(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    fake = FakeJudge()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def params_for(fake: FakeJudge, tmp_path, **kw) -> JudgeParams:
    values = dict(
        kind="llm",
        base_url=fake.url,
        model="judge-test",
        api_key_env=KEY_ENV,
        concurrency=4,
        timeout_s=5.0,
        max_retries=2,
        cache_path=str(tmp_path / "cache.sqlite"),
    )
    values.update(kw)
    return JudgeParams(**values)


def sample(i: int) -> dict:
    return {
        "sample_id": f"s{i}",
        "path": "m.py",
        "span_kind": "line",
        "prefix": f"def f{i}(x):\n    ",
        "suffix": "\n",
        "middle": "return x + 1",
    }


def test_well_formed_answers_are_scored_and_abstentions_not_sent(fake_judge, tmp_path):
    pairs = [(sample(0), "score:10"), (sample(1), "score:3"), (sample(2), "   "), (sample(3), "score:0")]
    run = judge(pairs, params_for(fake_judge, tmp_path))
    assert run.judge == "llm:judge-test"
    assert [v.score if v else None for v in run.verdicts] == [10, 3, None, 0]
    assert run.verdicts[0].note == "fits the context"
    assert run.requests == 3 and run.cache_hits == 0
    assert sorted(fake_judge.completions_sent()) == ["score:0", "score:10", "score:3"]
    body = fake_judge.requests[0]["body"]
    assert body["model"] == "judge-test" and body["temperature"] == 0
    assert fake_judge.requests[0]["auth"] == "Bearer sk-test"
    assert fake_judge.requests[0]["path"] == "/v1/chat/completions"


def test_malformed_answer_is_unscored_not_defaulted_and_not_cached(fake_judge, tmp_path):
    params = params_for(fake_judge, tmp_path)
    pairs = [(sample(0), "malformed"), (sample(1), "score:6"), (sample(2), "score:7")]
    first = llm_judge(pairs, params)
    assert [v.score for v in first.verdicts] == [None, 6, None]  # prose, a level, an off-level score
    assert first.verdicts[0].note.startswith("unscored: expected one <evaluation>")
    assert "not one of" in first.verdicts[2].note
    second = llm_judge(pairs, params)
    assert [v.score for v in second.verdicts] == [None, 6, None]
    # Only the scored answer was cached: the two unscored ones are asked again.
    assert second.requests == 2 and second.cache_hits == 1
    assert fake_judge.seen == {"malformed": 2, "score:6": 1, "score:7": 2}


def test_rate_limited_then_success_is_retried_by_the_client(fake_judge, tmp_path):
    run = llm_judge([(sample(0), "ratelimit-once")], params_for(fake_judge, tmp_path))
    assert run.verdicts[0].score == 8
    assert fake_judge.seen["ratelimit-once"] == 2


def test_timeout_then_success_is_retried(fake_judge, tmp_path):
    run = llm_judge([(sample(0), "slow-once")], params_for(fake_judge, tmp_path, timeout_s=0.3, max_retries=1))
    assert run.verdicts[0].score == 8
    assert fake_judge.seen["slow-once"] == 2


def test_timeout_past_retries_fails_loudly_or_falls_back_to_reference(fake_judge, tmp_path):
    pairs = [(sample(0), "slow-always"), (sample(1), "return x + 1")]
    with pytest.raises(JudgeUnavailable, match="APITimeoutError"):
        judge(pairs, params_for(fake_judge, tmp_path, timeout_s=0.3, max_retries=1))
    assert fake_judge.seen["slow-always"] == 2
    run = judge(pairs, params_for(fake_judge, tmp_path, timeout_s=0.3, max_retries=0, on_failure="reference"))
    assert run.judge.startswith("reference (fallback: ")
    # The whole batch is re-scored by the reference judge, never a mix of judges.
    assert [v.score for v in run.verdicts] == [v.score for v in reference_judge(pairs).verdicts]
    assert run.verdicts[1].score == 10


def dead_judge_params(tmp_path, monkeypatch, **kw) -> JudgeParams:
    """Params of a judge endpoint that refuses connections (bound, never served, then closed)."""
    monkeypatch.setenv(KEY_ENV, "sk-test")
    fake = FakeJudge()
    fake.server.server_close()
    values = dict(kind="llm", base_url=fake.url, model="m", api_key_env=KEY_ENV, max_retries=0, timeout_s=2.0)
    return JudgeParams(**values, cache_path=str(tmp_path / "c.sqlite"), **kw)


def test_endpoint_down_fails_loudly(tmp_path, monkeypatch):
    params = dead_judge_params(tmp_path, monkeypatch)
    with pytest.raises(JudgeUnavailable, match="APIConnectionError"):
        judge([(sample(0), "x = 1")], params)


def test_server_errors_exhaust_retries_then_unavailable(fake_judge, tmp_path):
    fake_judge.status_always = 503
    with pytest.raises(JudgeUnavailable, match="InternalServerError"):
        judge([(sample(0), "score:8")], params_for(fake_judge, tmp_path, max_retries=1))
    assert len(fake_judge.requests) == 2


def test_rejected_request_is_a_configuration_error_even_with_fallback(fake_judge, tmp_path):
    fake_judge.status_always = 401
    with pytest.raises(JudgeError, match="rejected the request") as err:
        judge([(sample(0), "score:8")], params_for(fake_judge, tmp_path, on_failure="reference"))
    assert not isinstance(err.value, JudgeUnavailable)
    assert len(fake_judge.requests) == 1  # 401 is not retried


def test_missing_api_key_names_the_variable(fake_judge, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(JudgeError, match=KEY_ENV):
        judge([(sample(0), "score:8")], params_for(fake_judge, tmp_path))
    assert fake_judge.requests == []


def test_cache_hits_on_rerun_cost_no_requests(fake_judge, tmp_path):
    params = params_for(fake_judge, tmp_path)
    pairs = [(sample(i), f"score:{s}") for i, s in enumerate((0, 3, 6, 8, 10))]
    pairs.append((sample(0), "score:0"))  # a duplicate prompt is asked once
    first = llm_judge(pairs, params)
    assert first.requests == 5 and len(fake_judge.requests) == 5
    second = llm_judge(pairs, params)
    assert second.requests == 0 and second.cache_hits == 5
    assert len(fake_judge.requests) == 5
    assert [v.score for v in second.verdicts] == [v.score for v in first.verdicts] == [0, 3, 6, 8, 10, 0]
    # The cache is keyed by judge model too: another model asks again.
    other = llm_judge(pairs[:1], params.model_copy(update={"model": "other-judge"}))
    assert other.requests == 1 and len(fake_judge.requests) == 6
    cache = JudgeCache(params.cache_path)
    assert cache.get("judge-test", judge_prompt(sample(1)["prefix"], sample(1)["suffix"], "score:3")) == answer(3)
    cache.close()


def test_concurrency_is_limited(fake_judge, tmp_path):
    fake_judge.delay_s = 0.15
    pairs = [(sample(i), f"score:{i % 2 * 10}") for i in range(8)]
    run = llm_judge(pairs, params_for(fake_judge, tmp_path, concurrency=2))
    assert len(run.verdicts) == 8 and all(v.score is not None for v in run.verdicts)
    assert fake_judge.max_in_flight == 2


@pytest.mark.parametrize(
    "text, score",
    [
        (answer(10), 10),
        ("Sure!\n" + answer(6) + "\n", 6),
        (answer(" 3 "), 3),
        (answer(7), None),  # off-level
        (answer(11), None),
        (answer("8.0"), None),
        (answer("eight"), None),
        ("<evaluation><score>8</score></evaluation>", None),  # no justification
        ("<evaluation><score>8</score><justification> </justification></evaluation>", None),
        (answer(8) + answer(3), None),  # two blocks
        ("<evaluation><score>8</score><score>3</score><justification>x</justification></evaluation>", None),
        ("<score>8</score><justification>x</justification>", None),  # no evaluation block
        ("", None),
    ],
)
def test_parse_verdict_is_strict(text, score):
    verdict = parse_verdict(text)
    assert isinstance(verdict, Verdict)
    assert verdict.score == score
    if score is None:
        assert verdict.note.startswith("unscored")


def test_prompt_carries_prefix_suffix_completion_and_levels():
    prompt = judge_prompt("def f(x):\n    ", "\n\nprint(f(1))", "return x")
    assert "<prefix>\ndef f(x):\n    \n</prefix>" in prompt
    assert "<suffix>\n\n\nprint(f(1))\n</suffix>" in prompt
    assert "<completion>\nreturn x\n</completion>" in prompt
    assert "<evaluation>" in prompt and "one of 0, 3, 6, 8, 10" in prompt


def test_endpoint_down_leaves_no_unread_task_exception(tmp_path, monkeypatch, caplog):
    """Every request failing at once: each failed task's exception is read, so none is logged later (at
    garbage collection, possibly inside another parse: a SystemError on Python 3.11 in CI)."""
    import gc
    import logging

    params = dead_judge_params(tmp_path, monkeypatch, concurrency=8)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(5):
            with pytest.raises(JudgeUnavailable):
                llm_judge([(sample(i), f"x = {i}") for i in range(8)], params)
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
