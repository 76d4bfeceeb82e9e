"""Durable logging for the gateway: group commit, and the row-level operations it commits.

``LogWriter`` runs one writer thread. Requests hand it an operation (a function of a connection)
and wait; the thread drains whatever is queued (up to ``serving.log_batch``), runs the operations
in one transaction and commits once, then wakes each caller with its own result. Under load many
requests share one fsync; each response still goes out only after its own row is committed.
Completion rows (``InsertRow``) of one group commit go in as one executemany per table, the
statement compiled once: building and compiling an INSERT per row cost more CPU than the row itself.
The thread keeps one connection open (no pool checkout or ping per commit) and opens a new one
after the store failed it. If the shared transaction fails, every operation is retried alone so
one bad row cannot fail its neighbours, and each caller gets its own answer or error; when the
store itself is unavailable (``STORE_UNAVAILABLE``: locked, unreachable) the whole batch fails at
once with that error.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from tasks.core.fim import QWEN
from tasks.core.store import completions, feedback

Op = Callable[[Connection], Any]

# Errors that mean the log store cannot be used right now (locked, unreachable, connection lost, pool
# exhausted), as opposed to one bad operation; the gateway answers them with 503 + Retry-After.
STORE_UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError, sa.exc.TimeoutError)
# The writer keeps its connection while commits follow each other; one idle longer than this goes back to
# the pool, whose pre-ping checks it before the next commit (a server may close idle connections).
RECHECK_IDLE_S = 1.0


@dataclass(frozen=True)
class InsertRow:
    """An operation that inserts one row: the writer batches these per table into one executemany."""

    table: sa.Table
    row: dict

    def __call__(self, conn: Connection) -> None:
        return InsertRow.run_many(conn, [self])[0]

    @staticmethod
    def run_many(conn: Connection, ops: list[InsertRow]) -> list[None]:
        by_table: dict[sa.Table, list[dict]] = {}
        for op in ops:
            by_table.setdefault(op.table, []).append(op.row)
        for table, rows in by_table.items():
            conn.execute(table.insert(), rows)
        return [None] * len(ops)


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


def suffix_form_prompt(prefix: str, suffix: str) -> str:
    """The prompt a request or outcome sent as prefix + suffix is keyed by (Qwen's rendering: a fixed
    convention, whichever model served it)."""
    return QWEN.render(prefix, suffix)


def prompt_hash(prompt: str, completion: str) -> str:
    """The key that matches a client's outcome (prompt, completion) to our logged completion."""
    return hashlib.sha256(f"{prompt}\0{completion}".encode()).hexdigest()


def insert_completion(row: dict) -> InsertRow:
    return InsertRow(completions, row)


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
    """Match an outcome to our completion (by id, else by prompt hash) and store it once (the
    /v1/feedback case, by our id, is ``RecordFeedback``: the same rule for a whole group commit).

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


_BY_IDS = sa.select(completions.c.id, completions.c.user_id, completions.c.arm).where(
    completions.c.id.in_(sa.bindparam("ids", expanding=True))
)
_ANSWERS = sa.select(feedback.c.completion_id, feedback.c.accepted).where(
    feedback.c.completion_id.in_(sa.bindparam("ids", expanding=True))
)


@functools.cache
def _insert_feedback(dialect: str) -> sa.Insert:
    """INSERT ... ON CONFLICT DO NOTHING RETURNING completion_id: the rows returned are the ones inserted."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return insert(feedback).on_conflict_do_nothing(index_elements=["completion_id"]).returning(feedback.c.completion_id)


@dataclass(frozen=True)
class RecordFeedback:
    """/v1/feedback: an outcome for one of our completions, by its id. The writer records all of a group
    commit's with at most three statements (find the completions, insert the answers, read the answers
    that were there first), with record_outcome's rule: only the caller's own completions (user_id; None with
    auth off), the first answer wins, unknown ids are not stored."""

    outcome: Outcome
    user_id: str | None

    def __call__(self, conn: Connection) -> Recorded:
        return RecordFeedback.run_many(conn, [self])[0]

    @staticmethod
    def run_many(conn: Connection, ops: list[RecordFeedback]) -> list[Recorded]:
        ids = sorted({op.outcome.completion_id or "" for op in ops})
        found = {row.id: row for row in conn.execute(_BY_IDS, {"ids": ids})}
        results: list[Recorded | None] = [None] * len(ops)
        first: dict[str, int] = {}  # completion id -> the op that inserts its answer (the first in the batch)
        for i, op in enumerate(ops):
            row = found.get(op.outcome.completion_id or "")
            if row is None:
                results[i] = Recorded("unknown", op.outcome.completion_id or "")
            elif op.user_id is not None and row.user_id != op.user_id:
                results[i] = Recorded("forbidden", row.id)
            else:
                first.setdefault(row.id, i)
        inserted: set[str] = set()
        if first:
            now = time.time()
            values = [
                {
                    "completion_id": cid,
                    "matched": True,
                    "accepted": ops[i].outcome.accepted,
                    "accepted_chars": ops[i].outcome.accepted_chars,
                    "received_at": now,
                    "source": ops[i].outcome.source,
                    "user_id": ops[i].user_id if ops[i].user_id is not None else found[cid].user_id,
                    "trainable": ops[i].outcome.trainable,
                    "payload": None,
                }
                for cid, i in first.items()
            ]
            inserted = set(conn.execute(_insert_feedback(conn.dialect.name), values).scalars())
        recorded = {i for cid, i in first.items() if cid in inserted}
        later = [i for i, result in enumerate(results) if result is None and i not in recorded]
        stored = {}  # the answer stored first, for ops whose answer was not the one inserted
        if later:
            wanted = sorted({ops[i].outcome.completion_id or "" for i in later})
            stored = dict(conn.execute(_ANSWERS, {"ids": wanted}).tuples().all())
        out: list[Recorded] = []
        for i, op in enumerate(ops):
            done = results[i]
            if done is None:
                row = found[op.outcome.completion_id or ""]
                if i in recorded:
                    done = Recorded("recorded", row.id, True, op.outcome.accepted, row.arm)
                else:
                    answer = stored[row.id]
                    status: Literal["duplicate", "conflict"] = (
                        "duplicate" if answer == op.outcome.accepted else "conflict"
                    )
                    done = Recorded(status, row.id, True, answer, row.arm)
            out.append(done)
        return out


BATCHED = (InsertRow, RecordFeedback)  # op kinds the writer runs as one set of statements per group commit
