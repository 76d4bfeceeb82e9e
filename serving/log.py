"""Durable logging for the gateway: group commit, and the row-level operations it commits.

``LogWriter`` runs one writer thread. Requests hand it an operation (a function of a connection)
and wait; the thread drains whatever is queued (up to ``serving.log_batch``), runs the operations
in one transaction and commits once, then wakes each caller with its own result. Under load many
requests share one fsync; each response still goes out only after its own row is committed.
If the shared transaction fails, every operation is retried alone so one bad row cannot fail its
neighbours, and each caller gets its own answer or error; when the store itself is unavailable
(``STORE_UNAVAILABLE``: locked, unreachable) the whole batch fails at once with that error.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from serving.store import completions, feedback
from tasks.fim import QWEN

Op = Callable[[Connection], Any]

# Errors that mean the log store cannot be used right now (locked, unreachable, connection lost, pool
# exhausted), as opposed to one bad operation; the gateway answers them with 503 + Retry-After.
STORE_UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError, sa.exc.TimeoutError)


class LogWriter:
    def __init__(self, engine: Engine, max_batch: int):
        self.engine = engine
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tabrl-log-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Commit what is queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    async def submit(self, op: Op) -> Any:
        """Run op(conn) in the next group commit; returns its result once committed."""
        if self._thread is None:
            raise RuntimeError("log writer is not running (the app's lifespan starts it)")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((op, future, loop))
        return await future

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stopping = False
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._commit(batch)
            if stopping:
                return

    def _commit(self, batch: list) -> None:
        try:
            with self.engine.begin() as conn:
                results = [op(conn) for op, _, _ in batch]
        except STORE_UNAVAILABLE as err:
            # The store itself is down or locked (not one bad row): retrying each row alone would only
            # wait the timeout once per row. Every caller gets the error (the gateway answers 503).
            for _, future, loop in batch:
                loop.call_soon_threadsafe(_resolve, future, None, err)
            return
        except sa.exc.SQLAlchemyError:
            for item in batch:
                self._commit_alone(item)
            return
        for (_, future, loop), result in zip(batch, results, strict=True):
            loop.call_soon_threadsafe(_resolve, future, result, None)

    def _commit_alone(self, item) -> None:
        op, future, loop = item
        try:
            with self.engine.begin() as conn:
                result = op(conn)
        except Exception as err:  # noqa: BLE001  (handed to the waiting request, which raises it: nothing is hidden)
            loop.call_soon_threadsafe(_resolve, future, None, err)
            return
        loop.call_soon_threadsafe(_resolve, future, result, None)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def suffix_form_prompt(prefix: str, suffix: str) -> str:
    """The prompt a request or outcome sent as prefix + suffix is keyed by (Qwen's rendering: a fixed
    convention, whichever model served it)."""
    return QWEN.render(prefix, suffix)


def prompt_hash(prompt: str, completion: str) -> str:
    """The key that matches a client's outcome (prompt, completion) to our logged completion."""
    return hashlib.sha256(f"{prompt}\0{completion}".encode()).hexdigest()


def insert_completion(row: dict) -> Op:
    def op(conn: Connection) -> None:
        conn.execute(completions.insert().values(**row))

    return op


def insert_ignore(conn: Connection, table: sa.Table, values: dict, key: str) -> bool:
    """INSERT unless a row with the same key exists (first write wins); True when inserted."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    stmt = insert(table).values(**values).on_conflict_do_nothing(index_elements=[key]).returning(table.c[key])
    return conn.execute(stmt).first() is not None


@dataclass(frozen=True)
class Outcome:
    """An accept/reject answer from any client, before it is matched to our log."""

    accepted: bool
    source: str  # api | rlinf | continue | import
    completion_id: str | None = None  # ours (from a response id) or the client's own
    prompt: str | None = None
    completion: str | None = None
    accepted_chars: int | None = None
    trainable: bool = True  # False for Continue's noCode events (texts withheld)
    payload: dict | None = None  # the client's texts, kept when the completion is not ours


@dataclass(frozen=True)
class Recorded:
    status: Literal["recorded", "duplicate", "conflict", "forbidden", "unknown"]
    completion_id: str
    matched: bool = False
    accepted: bool | None = None  # the stored answer (the first one)
    arm: str | None = None


def record_outcome(outcome: Outcome, user_id: str | None, require_ours: bool) -> Op:
    """Match an outcome to our completion (by id, else by prompt hash) and store it once.

    user_id: the caller; when given, only that user's completions match and another user's id is
    ``forbidden``. require_ours: the completion must be in our log (/v1/feedback), else the outcome
    is stored unmatched under the client's id.
    """

    def op(conn: Connection) -> Recorded:
        row = None
        if outcome.completion_id:
            row = conn.execute(
                sa.select(completions.c.id, completions.c.user_id, completions.c.arm).where(
                    completions.c.id == outcome.completion_id
                )
            ).first()
        if row is None and outcome.prompt is not None and outcome.completion is not None:
            query = (
                sa.select(completions.c.id, completions.c.user_id, completions.c.arm)
                .where(completions.c.prompt_hash == prompt_hash(outcome.prompt, outcome.completion))
                .order_by(completions.c.seq.desc())
                .limit(1)
            )
            if user_id is not None:
                query = query.where(completions.c.user_id == user_id)
            row = conn.execute(query).first()
        if row is not None and user_id is not None and row.user_id != user_id:
            return Recorded("forbidden", row.id)
        if row is None and require_ours:
            return Recorded("unknown", outcome.completion_id or "")
        key = (
            row.id
            if row is not None
            else (outcome.completion_id or f"{outcome.source}-{prompt_hash(str(outcome.payload), '')[:32]}")
        )
        inserted = insert_ignore(
            conn,
            feedback,
            {
                "completion_id": key,
                "matched": row is not None,
                "accepted": outcome.accepted,
                "accepted_chars": outcome.accepted_chars,
                "received_at": time.time(),
                "source": outcome.source,
                "user_id": user_id if user_id is not None else (row.user_id if row is not None else None),
                "trainable": outcome.trainable,
                "payload": None if row is not None else outcome.payload,
            },
            "completion_id",
        )
        arm = row.arm if row is not None else None
        if inserted:
            return Recorded("recorded", key, row is not None, outcome.accepted, arm)
        first = conn.execute(sa.select(feedback.c.accepted).where(feedback.c.completion_id == key)).scalar_one()
        return Recorded("duplicate" if first == outcome.accepted else "conflict", key, row is not None, first, arm)

    return op
