"""Security: hashed keys, nothing secret in logs, owner-only feedback, per-user and per-key rate
limits, request size limits, opt-out (by row counts) and retention (`tabrl purge`)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from flows.cli.main import app as cli
from serving.auth import add_key, set_opt_out
from serving.gateway import create_app
from serving.log import insert_completion, prompt_hash
from serving.retention import DurationError, parse_duration, purge
from tasks.core.store import Arm, Store, completions, feedback, init_schema, metadata, replace_arms
from tests.conftest import tiny_params
from tests.serving_util import serve_app
from tests.support.harness import editor_prompt, fast_backend_factory

SECRET = "AKIAZZZZSECRETPLANTED0000"  # planted in prompts: must never reach a log line


def _gateway(tmp_path, **serving):
    params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "db_timeout_s": 0.5, **serving})
    engine = Store(params.paths.database_url, timeout_s=params.serving.db_timeout_s).engine
    init_schema(engine)
    replace_arms(engine, [Arm("champion", "fast/1", "fast", "embedded", 1.0)])
    return params, engine


def _counts(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() for t in metadata.sorted_tables
        }


def test_keys_are_hashed_and_nothing_secret_reaches_the_logs(tmp_path, caplog):
    params, engine = _gateway(tmp_path)
    alice, bob = add_key(engine, "alice"), add_key(engine, "bob")
    app = create_app(params, engine=engine, auth=True, backend_factory=fast_backend_factory)
    prompt = editor_prompt(0).replace("def f0", f"KEY = '{SECRET}'\ndef f0")
    caplog.set_level(logging.DEBUG)  # every logger, every level: the gateway's, uvicorn's, httpx's, SQLAlchemy's
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {alice}"}, json={"prompt": prompt})
        assert r.status_code == 200
        cid = r.json()["id"]
        # Answers that log: bad key, someone else's completion, bad body with the secret, a locked store.
        assert (
            client.post(
                "/v1/completions", headers={"Authorization": f"Bearer {alice}x"}, json={"prompt": prompt}
            ).status_code
            == 401
        )
        assert (
            client.post(
                "/v1/feedback",
                headers={"Authorization": f"Bearer {bob}"},
                json={"completion_id": cid, "accepted": True},
            ).status_code
            == 403
        )
        assert (
            client.post(
                "/api/training/submit",
                headers={"Authorization": f"Bearer {alice}"},
                json={"prompt": prompt, "completion": SECRET, "accepted": "maybe"},
            ).status_code
            == 422
        )
        import sqlite3

        locker = sqlite3.connect(str(tmp_path / "tabrl.db"))
        locker.execute("BEGIN EXCLUSIVE")
        try:
            locked = client.post(
                "/v1/completions", headers={"Authorization": f"Bearer {alice}"}, json={"prompt": prompt}
            )
        finally:
            locker.rollback()
            locker.close()
        assert locked.status_code in (200, 503)
    text = "\n".join(r.getMessage() + " " + str(r.args) for r in caplog.records)
    assert caplog.records  # something was logged, and none of it is a secret
    for secret in (alice, bob, alice[len("tabrl-") :], SECRET, "def f0"):
        assert secret not in text
    # The store keeps only sha256 hashes of keys: no table, no byte of the database file holds a key.
    with engine.connect() as conn:
        dump = repr([conn.execute(sa.select(t)).all() for t in metadata.sorted_tables])
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("tabrl.db*"))
    for key in (alice, bob):
        assert key not in dump and key.encode() not in raw
    engine.dispose()


def test_feedback_only_from_the_owner(tmp_path):
    params, engine = _gateway(tmp_path)
    alice, bob = add_key(engine, "alice"), add_key(engine, "bob")
    app = create_app(params, engine=engine, auth=True, backend_factory=fast_backend_factory)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        cid = client.post(
            "/v1/completions", headers={"Authorization": f"Bearer {alice}"}, json={"prompt": editor_prompt(0)}
        ).json()["id"]
        assert client.post("/v1/feedback", json={"completion_id": cid, "accepted": True}).status_code == 401
        r = client.post(
            "/v1/feedback", headers={"Authorization": f"Bearer {bob}"}, json={"completion_id": cid, "accepted": True}
        )
        assert r.status_code == 403 and "another user" in r.json()["error"]["message"]
        assert _counts(engine)["feedback"] == 0
        assert (
            client.post(
                "/v1/feedback",
                headers={"Authorization": f"Bearer {alice}"},
                json={"completion_id": cid, "accepted": False},
            ).status_code
            == 200
        )
    with engine.connect() as conn:
        assert conn.execute(sa.select(feedback.c.accepted, feedback.c.user_id)).all() == [(False, "alice")]
    engine.dispose()


def test_rate_limits_per_user_and_per_key(tmp_path):
    params, engine = _gateway(tmp_path, rate_limit_per_minute=5, rate_limit_per_key_per_minute=3)
    first, second = add_key(engine, "alice"), add_key(engine, "alice")  # one user, two keys
    app = create_app(params, engine=engine, auth=True, backend_factory=fast_backend_factory)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:

        def ask(key):
            return client.post(
                "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={"prompt": editor_prompt(0)}
            )

        assert [ask(first).status_code for _ in range(4)] == [200, 200, 200, 429]  # the key's limit
        limited = ask(first)
        assert "per API key" in limited.json()["error"]["message"] and int(limited.headers["Retry-After"]) >= 1
        assert [ask(second).status_code for _ in range(3)] == [200, 200, 429]  # then the user's limit (5 in all)
        assert "per user" in ask(second).json()["error"]["message"]
    assert _counts(engine)["completions"] == 5  # a refused request stores nothing
    engine.dispose()


def test_request_size_limits(tmp_path):
    params, engine = _gateway(tmp_path, max_prompt_chars=1000, max_text_chars=500, max_body_bytes=4096, auth=False)
    app = create_app(params, engine=engine, auth=False, backend_factory=fast_backend_factory)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        big = client.post("/v1/completions", json={"prompt": "x" * 2000, "suffix": ""})
        assert big.status_code == 413 and "prompt is 2000 characters" in big.json()["error"]["message"]
        body = client.post("/v1/completions", json={"prompt": "x", "suffix": "", "padding": "y" * 10_000})
        assert body.status_code == 413 and "limit is 4096" in body.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"z" * 1000
            yield b'", "suffix": ""}'

        chunked = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413 and "exceeds the limit" in chunked.json()["error"]["message"]
        text = client.post("/api/training/submit", json={"accepted": True, "prefix": "p" * 600, "suffix": "s"})
        assert text.status_code == 413
        assert client.post("/v1/feedback", json={"completion_id": "c" * 500, "accepted": True}).status_code == 422
    assert _counts(engine)["completions"] == 0 and _counts(engine)["feedback"] == 0
    engine.dispose()


def test_opt_out_stores_nothing(tmp_path):
    params, engine = _gateway(tmp_path)
    alice, carol = add_key(engine, "alice"), add_key(engine, "carol")
    set_opt_out(engine, "carol", True)
    app = create_app(params, engine=engine, auth=True, backend_factory=fast_backend_factory)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        before = _counts(engine)
        for key, headers in ((carol, {}), (alice, {"X-Tabrl-Opt-Out": "1"})):
            h = {"Authorization": f"Bearer {key}", **headers}
            r = client.post("/v1/completions", headers=h, json={"prompt": editor_prompt(1)})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] and r.json()["tabrl"]["logged"] is False
            assert client.post(
                "/v1/feedback", headers=h, json={"completion_id": r.json()["id"], "accepted": True}
            ).json() == {"logged": False}
            assert client.post(
                "/api/training/submit", headers=h, json={"accepted": True, "prompt": "p", "completion": "c"}
            ).json() == {"logged": False}
        assert _counts(engine) == before  # every table: not one row more
        assert (
            client.post(
                "/v1/completions", headers={"Authorization": f"Bearer {alice}"}, json={"prompt": editor_prompt(1)}
            ).json()["tabrl"]["logged"]
            is True
        )
    assert _counts(engine)["completions"] == before["completions"] + 1
    engine.dispose()


def _row(i: int, created_at: float) -> dict:
    return {
        "id": f"cmpl-{i:032x}",
        "created_at": created_at,
        "user_id": "u",
        "arm": "champion",
        "model_version": "v",
        "prompt": "p",
        "prefix": "p",
        "suffix": "s",
        "completion": "c",
        "token_ids": [1],
        "logprobs": [-0.1],
        "temperature": 0.7,
        "latency_ms": 1.0,
        "abstained": False,
        "prompt_hash": prompt_hash("p", "c"),
    }


def test_purge_deletes_old_rows_in_batches_and_the_cli_prints_counts(tmp_path):
    params, engine = _gateway(tmp_path)
    now = time.time()
    day = 86400
    with engine.begin() as conn:
        for i in range(25):  # 20 old, 5 recent
            insert_completion(_row(i, now - (40 if i < 20 else 1) * day))(conn)
        conn.execute(
            feedback.insert(),
            [
                {
                    "completion_id": f"cmpl-{i:032x}",
                    "matched": True,
                    "accepted": True,
                    "received_at": now - (1 if i % 2 else 40) * day,
                    "source": "api",
                    "user_id": "u",
                    "trainable": True,
                }
                for i in range(0, 25, 1)
            ]
            + [
                {
                    "completion_id": "rlinf-old",
                    "matched": False,
                    "accepted": False,
                    "received_at": now - 40 * day,
                    "source": "rlinf",
                    "user_id": "u",
                    "trainable": True,
                    "payload": {"prompt": "secret"},
                }
            ],
        )
    assert purge(engine, 30 * day, batch=7, dry_run=True).completions == 20 and _counts(engine)["completions"] == 25
    runner = CliRunner()
    result = runner.invoke(
        cli,
        ["purge", "--older-than", "30d", "--batch", "7", "--set", f"paths.database_url={params.paths.database_url}"],
    )
    assert result.exit_code == 0, result.output
    assert "deleted 20 completions, 24 feedback" in result.output
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(completions.c.id)).scalars()) == [f"cmpl-{i:032x}" for i in range(20, 25)]
        # left: feedback received recently for a recent completion
        assert sorted(conn.execute(sa.select(feedback.c.completion_id)).scalars()) == [
            f"cmpl-{i:032x}" for i in (21, 23)
        ]
    bad = runner.invoke(cli, ["purge", "--older-than", "a month"])
    assert bad.exit_code == 2 and "--older-than" in bad.output
    engine.dispose()


@pytest.mark.parametrize(
    "text,seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("1.5w", 907200), ("45s", 45)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_nonsense():
    with pytest.raises(DurationError, match="number and a unit"):
        parse_duration("30 days")
