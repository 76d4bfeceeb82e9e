"""Durable logging for the gateway: group commit of the row-level operations of ``serving/records.py``.

``LogWriter`` runs one writer thread. Requests hand it an operation (a function of a connection)
and wait; the thread drains whatever is queued (up to ``serving.log_batch``), runs the operations
in one transaction and commits once, then wakes each caller with its own result. Under load many
requests share one fsync; each response still goes out only after its own row is committed.
Completion rows (``InsertRow``, ``serving/records.py``) of one group commit go in as one executemany per table, the
statement compiled once: building and compiling an INSERT per row cost more CPU than the row itself.
The thread keeps one connection open (no pool checkout or ping per commit) and opens a new one
after the store failed it. If the shared transaction fails, every operation is retried alone so
one bad row cannot fail its neighbours, and each caller gets its own answer or error; when the
store itself is unavailable (``STORE_UNAVAILABLE``: locked, unreachable) the whole batch fails at
once with that error.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from serving.records import (
    BATCHED,
    InsertRow,
    Op,
    Outcome,
    Recorded,
    RecordFeedback,
    insert_completion,
    mark_cancelled,
    prompt_hash,
    record_outcome,
    suffix_form_prompt,
)

__all__ = [
    "BATCHED",
    "STORE_UNAVAILABLE",
    "InsertRow",
    "LogWriter",
    "Op",
    "Outcome",
    "RecordFeedback",
    "Recorded",
    "insert_completion",
    "mark_cancelled",
    "prompt_hash",
    "record_outcome",
    "suffix_form_prompt",
]

# Errors that mean the log store cannot be used right now (locked, unreachable, connection lost, pool
# exhausted), as opposed to one bad operation; the gateway answers them with 503 + Retry-After.
STORE_UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError, sa.exc.TimeoutError)
# The writer keeps its connection while commits follow each other; one idle longer than this goes back to
# the pool, whose pre-ping checks it before the next commit (a server may close idle connections).
RECHECK_IDLE_S = 1.0


class LogWriter:
    def __init__(self, engine: Engine, max_batch: int):
        self.engine = engine
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None  # the writer thread's own; None until first use or after a failure
        self._used_at = 0.0

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
        try:
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
        finally:
            self._close()

    def _connection(self) -> tuple[Connection, bool]:
        """The writer's connection, and whether it was held from an earlier commit (True) or just checked out
        of the pool, which pings it first (False)."""
        if self._conn is not None and time.monotonic() - self._used_at > RECHECK_IDLE_S:
            self._close()  # idle a while: the server may have dropped it; the pool pings on the next checkout
        held = self._conn is not None
        if self._conn is None:
            self._conn = self.engine.connect()
        self._used_at = time.monotonic()
        return self._conn, held

    def _close(self, invalidate: bool = False) -> None:
        if self._conn is not None:
            if invalidate:
                self._conn.invalidate()  # the store broke it: never hand it out again
            self._conn.close()
            self._conn = None

    def _transaction(self, ops: list[Op]) -> list[Any]:
        """Run ops in one transaction: the rows of InsertRow ops first, one executemany per table (no op can
        depend on a row another op of the same batch inserts: a client only learns a completion id after its
        commit), then the others in order. A held connection the server dropped in between (a disconnect
        before COMMIT was sent, so nothing was written) is replaced and the transaction run once more."""
        conn, held = self._connection()
        applied = False
        try:
            with conn.begin():
                results = self._apply(conn, ops)
                applied = True
            return results
        except STORE_UNAVAILABLE as err:
            self._close(invalidate=True)
            if held and not applied and getattr(err, "connection_invalidated", False):
                conn, _ = self._connection()
                with conn.begin():
                    return self._apply(conn, ops)
            raise

    @staticmethod
    def _apply(conn: Connection, ops: list[Op]) -> list[Any]:
        """Batched kinds first, each as one set of statements for all its ops, then the others one by one
        (the ops of one group commit count as simultaneous)."""
        results: list[Any] = [None] * len(ops)
        for kind in BATCHED:
            at = [i for i, op in enumerate(ops) if type(op) is kind]
            if at:
                for i, result in zip(at, kind.run_many(conn, [ops[i] for i in at]), strict=True):
                    results[i] = result
        for i, op in enumerate(ops):
            if type(op) not in BATCHED:
                results[i] = op(conn)
        return results

    def _commit(self, batch: list) -> None:
        try:
            results = self._transaction([op for op, _, _ in batch])
        except STORE_UNAVAILABLE as err:
            # The store itself is down or locked (not one bad row): retrying each row alone would only
            # wait the timeout once per row. Every caller gets the error (the gateway answers 503).
            _wake(batch, [None] * len(batch), [err] * len(batch))
            return
        except sa.exc.SQLAlchemyError:  # one bad operation (the transaction was rolled back): find which
            outcomes = [self._commit_alone(op) for op, _, _ in batch]
            _wake(batch, [r for r, _ in outcomes], [e for _, e in outcomes])
            return
        _wake(batch, results, [None] * len(batch))

    def _commit_alone(self, op: Op) -> tuple[Any, BaseException | None]:
        try:
            return self._transaction([op])[0], None
        except Exception as err:  # noqa: BLE001  (handed to the waiting request, which raises it: nothing is hidden)
            return None, err


def _wake(batch: list, results: list[Any], errors: list[BaseException | None]) -> None:
    """Hand each caller its result or error: one wake-up per event loop, not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for (_, future, loop), result, error in zip(batch, results, errors, strict=True):
        by_loop.setdefault(loop, []).append((future, result, error))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_resolve_all, items)


def _resolve_all(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, error in items:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
