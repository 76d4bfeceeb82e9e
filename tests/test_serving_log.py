"""The log writer's group commit on real stores: batched feedback answers exactly like one-by-one recording,
one bad row does not fail its neighbours, and the auth cache reads once for concurrent misses."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import sqlalchemy as sa

from serving.auth import TtlCache
from serving.log import InsertRow, LogWriter, Outcome, RecordFeedback, insert_completion, prompt_hash, record_outcome
from tasks.core.store import Store, completions, feedback, init_schema
from tests.support.harness import throwaway_schema


def _row(cid: str, user: str) -> dict:
    return {
        "id": cid,
        "created_at": time.time(),
        "user_id": user,
        "arm": "champion",
        "model_version": "m/1",
        "prompt": "p",
        "prefix": "p",
        "suffix": "",
        "completion": "c",
        "token_ids": [1],
        "logprobs": [-0.5],
        "temperature": 1.0,
        "latency_ms": 1.0,
        "abstained": False,
        "prompt_hash": prompt_hash("p", "c"),
    }


def _seeded(url: str):
    engine = Store(url).engine
    init_schema(engine)
    with engine.begin() as conn:
        for cid, user in [("c1", "alice"), ("c2", "bob"), ("c3", "alice"), ("c4", "carol")]:
            insert_completion(_row(cid, user))(conn)
        record_outcome(Outcome(False, "api", "c3"), "alice", require_ours=True)(conn)  # answered before
    return engine


# (completion id, accepted, caller; None = auth off): every case of the rule, several in one batch
BATCH = [
    ("c1", True, "alice"),  # recorded
    ("c1", True, "alice"),  # the same answer again in the same batch: duplicate
    ("c1", False, "alice"),  # another answer in the same batch: conflict, the first wins
    ("c2", True, "alice"),  # bob's completion: forbidden
    ("cmpl-nope", True, "alice"),  # unknown
    ("c3", True, "alice"),  # answered False before: conflict
    ("c3", False, "alice"),  # duplicate of the stored answer
    ("c4", True, None),  # auth off: recorded under the completion's user
]


@pytest.fixture
def two_stores(store_url, tmp_path):
    """The same seeded store twice (SQLite files, or two PostgreSQL schemas)."""
    if store_url.startswith("sqlite"):
        yield _seeded(store_url), _seeded(f"sqlite:///{tmp_path}/other.db")
        return
    base = store_url.split("?")[0]
    with throwaway_schema(base) as other:
        yield _seeded(store_url), _seeded(other)


def test_batched_feedback_answers_like_record_outcome_one_by_one(two_stores):
    one_by_one, batched = two_stores
    outcomes = [(Outcome(accepted, "api", cid), user) for cid, accepted, user in BATCH]
    with one_by_one.begin() as conn:
        expected = [record_outcome(o, user, require_ours=True)(conn) for o, user in outcomes]
    with batched.begin() as conn:
        got = RecordFeedback.run_many(conn, [RecordFeedback(o, user) for o, user in outcomes])
    assert [r.status for r in expected] == [
        "recorded",
        "duplicate",
        "conflict",
        "forbidden",
        "unknown",
        "conflict",
        "duplicate",
        "recorded",
    ]
    assert got == expected

    def stored(engine):
        with engine.connect() as conn:
            rows = conn.execute(sa.select(feedback).order_by(feedback.c.completion_id)).mappings().all()
        return [{k: v for k, v in r.items() if k not in ("seq", "received_at")} for r in rows]

    assert stored(batched) == stored(one_by_one) and len(stored(batched)) == 3
    one_by_one.dispose()
    batched.dispose()


def test_one_bad_row_does_not_fail_its_neighbours(store_url):
    engine = Store(store_url).engine
    init_schema(engine)
    with engine.begin() as conn:
        insert_completion(_row("taken", "alice"))(conn)
    writer = LogWriter(engine, max_batch=64)
    writer.start()
    gate = threading.Event()

    async def main():
        blocker = asyncio.ensure_future(writer.submit(lambda conn: gate.wait(10)))  # holds the writer thread
        await asyncio.sleep(0.2)
        ops = [insert_completion(_row(f"ok{i}", "alice")) for i in range(4)] + [insert_completion(_row("taken", "bob"))]
        ops.insert(2, RecordFeedback(Outcome(True, "api", "taken"), "alice"))
        pending = [asyncio.ensure_future(writer.submit(op)) for op in ops]  # queued behind the blocker: one batch
        await asyncio.sleep(0.2)
        gate.set()
        await blocker
        return await asyncio.gather(*pending, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        writer.stop()
    assert isinstance(results[-1], sa.exc.IntegrityError)  # the duplicate id, alone
    assert results[:2] + results[3:-1] == [None] * 4
    assert results[2].status == "recorded"
    with engine.connect() as conn:
        ids = set(conn.execute(sa.select(completions.c.id)).scalars())
        owner = conn.execute(sa.select(completions.c.user_id).where(completions.c.id == "taken")).scalar_one()
    assert ids == {"taken", "ok0", "ok1", "ok2", "ok3"} and owner == "alice"
    assert isinstance(insert_completion(_row("x", "y")), InsertRow)
    engine.dispose()


def test_concurrent_cache_misses_share_one_read_and_failures_are_not_kept():
    reads: list[str] = []

    def read(value):
        def go():
            reads.append(value)
            time.sleep(0.05)
            if value == "boom":
                raise RuntimeError("store down")
            return None if value == "none" else value

        return go

    async def main():
        cache = TtlCache(60.0, keep=lambda v: v is not None)
        same = await asyncio.gather(*[cache.get("k", read("v")) for _ in range(20)])
        assert same == ["v"] * 20 and reads == ["v"]
        assert await cache.get("k", read("v2")) == "v"  # within the TTL: no read
        for _ in range(2):  # unknown (None) and failed reads are read again next time
            assert await cache.get("n", read("none")) is None
            with pytest.raises(RuntimeError):
                await cache.get("b", read("boom"))
        assert reads == ["v", "none", "boom", "none", "boom"]
        expired = TtlCache(0.0)
        await expired.get("k", read("a"))
        assert await expired.get("k", read("b")) == "b"

    asyncio.run(main())
