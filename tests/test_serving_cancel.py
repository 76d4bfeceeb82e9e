"""What was never shown is not a rejection (issue 53): a client that hangs up before its answer, over real HTTP,
leaves a cancelled row that no count and no snapshot takes; `shown: false` and a reporting client's silence are
"not shown"; the embedded backend stops generating when its request is cancelled."""

from __future__ import annotations

import asyncio
import time

import httpx
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from serving.auth import add_key
from serving.gateway import create_app
from tasks.core.engines.base import Sampling
from tasks.core.engines.embedded import EmbeddedBackend
from tasks.core.fim import QWEN
from tasks.core.generate import generate, load_model
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, completions, feedback, init_schema, replace_arms
from tasks.deploy.ab import arm_stats
from tasks.ingest.snapshot import run_ingest
from tests.conftest import tiny_params
from tests.serving_util import serve_app
from tests.support.harness import VllmStandIn, delayed_factory

PROMPT = QWEN.render("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")


def _gateway(store_url, tmp_path, arms, factory=None, **ingest):
    params = tiny_params(
        tmp_path,
        # suggestions shown whole, at a temperature where the test model rarely answers with nothing
        serving={"config_ttl_s": 0, "max_tokens": 8, "min_logprob": None, "temperature": 0.7},
        ingest={"feedback_timeout_s": 0.5, "reported_timeout_s": 1.0, **ingest},
    )
    engine = Store(store_url).engine
    init_schema(engine)
    replace_arms(engine, arms)
    kwargs = {} if factory is None else {"backend_factory": factory}
    return params, engine, create_app(params, engine=engine, auth=True, **kwargs)


def _rows(engine, table) -> dict[str, dict]:
    key = "id" if table is completions else "completion_id"
    with engine.connect() as conn:
        return {r[key]: dict(r) for r in conn.execute(sa.select(table)).mappings()}


def _hang_up(url: str, key: str, after_s: float, **body) -> None:
    """POST a completion and hang up after `after_s` seconds, as an editor aborts a superseded request."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/completions",
            json={"prompt": PROMPT, **body},
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(after_s, connect=5.0),
        )


def _wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_hang_up_mid_generation_is_cancelled_counted_apart_and_never_snapshotted(store_url, tmp_path):
    """A real HTTP client hangs up while the (vLLM-protocol) server is still generating: the gateway stops the
    generation (the server sees its client go away, as vLLM aborts), logs the row as cancelled, and the A/B
    numbers, /metrics and the next snapshot leave it out; nothing else stored changes."""
    server = VllmStandIn(hold_s=0.0)
    with serve_app(server.app()) as server_url:
        arm = Arm(CHAMPION, "stand-in/1", server_url, "vllm", 1.0)
        params, engine, app = _gateway(store_url, tmp_path, [arm])
        key = add_key(engine, "alice")
        with serve_app(app) as url:
            headers = {"Authorization": f"Bearer {key}"}
            shown = [  # three requests at three cursors (the cleaning drops repeats)
                httpx.post(url + "/v1/completions", json={"prompt": p}, headers=headers, timeout=30).json()["id"]
                for p in (PROMPT, PROMPT.replace("add", "sub"), PROMPT.replace("add", "mul"))
            ]
            r = httpx.post(
                url + "/v1/feedback", json={"completion_id": shown[0], "accepted": True}, headers=headers, timeout=30
            )
            assert r.status_code == 200
            server.hold_s = 5.0  # the next request is still generating when its client hangs up
            _hang_up(url, key, 0.3)
            _wait_for(lambda: server.aborted == 1)  # the gateway hung up on the server: generation stopped
            _wait_for(lambda: len(_rows(engine, completions)) == 4)
            before = _rows(engine, completions)
            cancelled = [cid for cid, row in before.items() if row["cancelled_at"] is not None]
            assert len(cancelled) == 1 and cancelled[0] not in shown
            row = before[cancelled[0]]
            assert row["completion"] == "" and row["token_ids"] is None and row["user_id"] == "alice"
            assert row["latency_ms"] >= 300  # it waited for the model until the hang-up
            metrics = httpx.get(url + "/metrics", timeout=30).text
            got = {
                s.name: s.value
                for family in text_string_to_metric_families(metrics)
                for s in family.samples
                if s.name == "tabrl_cancelled_total"
            }
            assert got == {"tabrl_cancelled_total": 1.0}
        time.sleep(params.ingest.feedback_timeout_s + 0.2)
        stats = arm_stats(engine, params, since=0.0)[CHAMPION]
        assert (stats.requests, stats.accepted, stats.rejected, stats.cancelled) == (3, 1, 2, 1)
        assert stats.cancel_rate == 0.25
        feedback_before = _rows(engine, feedback)
        result = run_ingest(engine, params, tmp_path / "repo", now=time.time())
        table = pq.read_table(result.snapshot)
        assert sorted(table.column("completion_id").to_pylist()) == sorted(shown)  # the cancelled row is left out
        assert result.arms[CHAMPION].cancelled == 1 and result.arms[CHAMPION].requests == 3
        assert result.watermark == max(r["seq"] for r in before.values())  # and the watermark passed it
        assert _rows(engine, completions) == before and _rows(engine, feedback) == feedback_before
    engine.dispose()


def test_a_hang_up_after_generation_keeps_the_suggestion_and_is_not_a_rejection(store_url, tmp_path, tiny_model_dir):
    """An answer that was ready but not yet sent when the client hung up: the row keeps the model's suggestion
    (what an older gateway logged and counted as shown and rejected) and is cancelled."""
    arms = [Arm(CHAMPION, "tiny/1", str(tiny_model_dir), "embedded", 1.0)]
    params, engine, app = _gateway(store_url, tmp_path, arms, factory=delayed_factory({CHAMPION: 3.0}))
    key = add_key(engine, "alice")
    with serve_app(app) as url:
        _hang_up(url, key, 0.5, max_tokens=4)
        _wait_for(lambda: len(_rows(engine, completions)) == 1)
    (row,) = _rows(engine, completions).values()
    assert row["cancelled_at"] is not None and row["token_ids"]  # the generation had finished
    time.sleep(params.ingest.feedback_timeout_s + 0.2)
    stats = arm_stats(engine, params, since=0.0)[CHAMPION]
    assert (stats.requests, stats.rejected, stats.cancelled) == (0, 0, 1)
    engine.dispose()


def test_not_shown_feedback_and_a_reporting_clients_silence_are_never_rejections(store_url, tmp_path, tiny_model_dir):
    arms = [
        Arm(CHAMPION, "tiny/1", str(tiny_model_dir), "embedded", 0.5),
        Arm(CHALLENGER, "tiny/2", str(tiny_model_dir), "embedded", 0.5),
    ]
    params, engine, app = _gateway(store_url, tmp_path, arms)
    silent, reporting = add_key(engine, "silent"), add_key(engine, "reporter", reports_outcomes=True)
    with serve_app(app) as url:

        def ask(key: str) -> str:
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4},
                headers={"Authorization": f"Bearer {key}", "X-Tabrl-Arm": CHAMPION},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            return r.json()["id"]

        def tell(key: str, body: dict) -> httpx.Response:
            return httpx.post(url + "/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)

        discarded, quiet, quiet_reporter, rejected = ask(silent), ask(silent), ask(reporting), ask(reporting)
        assert tell(silent, {"completion_id": discarded, "shown": False}).json()["shown"] is False
        assert tell(silent, {"completion_id": discarded, "shown": False}).json()["duplicate"] is True
        assert tell(silent, {"completion_id": discarded, "accepted": False}).status_code == 409  # it changed
        bad = tell(silent, {"completion_id": quiet, "shown": False, "accepted": True})
        assert bad.status_code == 422 and "cannot be accepted" in bad.text
        assert tell(silent, {"completion_id": quiet}).status_code == 422  # neither an answer nor shown=false
        time.sleep(params.ingest.feedback_timeout_s + 0.1)  # past a silent client's deadline, within the reporter's
        assert tell(reporting, {"completion_id": rejected, "accepted": False}).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'tabrl_not_shown_total{arm="champion",team="org"} 1.0' in metrics
    rows = _rows(engine, completions)
    assert [rows[c]["reports_outcomes"] for c in (discarded, quiet, quiet_reporter, rejected)] == [
        False,
        False,
        True,
        True,
    ]
    time.sleep(params.ingest.reported_timeout_s)
    stats = arm_stats(engine, params, since=0.0)[CHAMPION]
    # discarded: not shown (it said so); quiet: rejected (silence); quiet_reporter: not shown (no report from a
    # reporting client); rejected: the reporter's rejection, 0.6 s after the silent rule's deadline, counts
    assert (stats.requests, stats.rejected, stats.not_shown, stats.timed_out) == (2, 2, 2, 1)
    result = run_ingest(engine, params, tmp_path / "repo", now=time.time())
    outcomes = dict(
        zip(*(pq.read_table(result.snapshot).column(c).to_pylist() for c in ("completion_id", "outcome")), strict=True)
    )
    assert outcomes == {quiet: "rejected", rejected: "rejected"}
    assert result.arms[CHAMPION].not_shown == 2
    engine.dispose()


def test_generation_stops_at_the_next_token_once_abandoned(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    steps = []

    def abandoned() -> bool:
        steps.append(1)
        return len(steps) >= 2

    (gen,) = generate(*lm, [PROMPT], 64, temperature=1.0, seed=0, abandoned=abandoned)
    assert len(gen.token_ids) == 2 and gen.finish_reason == "length"


def test_a_cancelled_embedded_request_frees_the_model_for_the_next(babbler_dir, monkeypatch):
    """The worker thread of a cancelled request stops at its next token instead of generating on with the model's
    lock held (a request still waiting for the lock never starts)."""
    import tasks.core.engines.embedded as backends

    made = []
    real = backends.generate

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(len(out[0].token_ids))
        return out

    monkeypatch.setattr(backends, "generate", counting)
    backend = EmbeddedBackend(babbler_dir)  # never stops on its own

    async def run() -> None:
        await backend.complete(PROMPT, Sampling(1, 1.0))  # loaded
        slow = asyncio.ensure_future(backend.complete(PROMPT, Sampling(400, 0.0, stop=())))
        queued = asyncio.ensure_future(backend.complete(PROMPT, Sampling(400, 0.0, stop=())))
        await asyncio.sleep(0.1)
        slow.cancel()
        queued.cancel()
        await asyncio.gather(slow, queued, return_exceptions=True)
        await backend.complete(PROMPT, Sampling(1, 1.0))  # waits for the lock: the cancelled ones let go of it
        await backend.aclose()

    asyncio.run(run())
    assert len(made) == 3 and made[0] == 1 and made[2] == 1  # the queued one never generated
    assert 0 < made[1] < 400
