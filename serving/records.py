"""The rows the gateway logs, and how a client's outcome is matched to its completion.

Each is an operation (a function of a connection) that ``serving/log.py``'s ``LogWriter`` commits in a group:
completion rows (``InsertRow``), outcomes matched by our id (``RecordFeedback``: one set of statements for a
whole group commit, the kinds in ``BATCHED``) or by prompt hash (``record_outcome``).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from tasks.core.fim import QWEN
from tasks.core.store import completions, feedback
from tasks.core.teams import loaded

Op = Callable[[Connection], Any]


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


def suffix_form_prompt(prefix: str, suffix: str) -> str:
    """The prompt a request or outcome sent as prefix + suffix is keyed by (Qwen's rendering: a fixed
    convention, whichever model served it)."""
    return QWEN.render(prefix, suffix)


def prompt_hash(prompt: str, completion: str) -> str:
    """The key that matches a client's outcome (prompt, completion) to our logged completion."""
    return hashlib.sha256(f"{prompt}\0{completion}".encode()).hexdigest()


def insert_completion(row: dict) -> InsertRow:
    return InsertRow(completions, row)


def mark_cancelled(completion_id: str, at: float) -> Op:
    """Stamp a committed completion as cancelled: its client hung up before the answer was sent."""

    def op(conn: Connection) -> None:
        conn.execute(
            completions.update()
            .where(completions.c.id == completion_id, completions.c.cancelled_at.is_(None))
            .values(cancelled_at=at)
        )

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
    shown: bool = True  # False: the client never displayed the suggestion (accepted is then False)


@dataclass(frozen=True)
class Recorded:
    status: Literal["recorded", "duplicate", "conflict", "forbidden", "unknown"]
    completion_id: str
    matched: bool = False
    accepted: bool | None = None  # the stored answer (the first one)
    arm: str | None = None
    shown: bool | None = None  # the stored answer's `shown` (the first one)
    arm_team: str | None = None  # the team whose arm served it (None when unmatched)


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
                sa.select(completions.c.id, completions.c.user_id, completions.c.arm, completions.c.arm_team).where(
                    completions.c.id == outcome.completion_id
                )
            ).first()
        if row is None and outcome.prompt is not None and outcome.completion is not None:
            query = (
                sa.select(completions.c.id, completions.c.user_id, completions.c.arm, completions.c.arm_team)
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
                "shown": outcome.shown,
            },
            "completion_id",
        )
        if inserted:
            return _recorded("recorded", key, row, outcome.accepted, outcome.shown)
        first = conn.execute(_ANSWERS, {"ids": [key]}).one()
        status: Literal["duplicate", "conflict"] = "duplicate" if _same(first, outcome) else "conflict"
        return _recorded(status, key, row, first.accepted, _shown(first.shown))

    return op


_BY_IDS = sa.select(completions.c.id, completions.c.user_id, completions.c.arm, completions.c.arm_team).where(
    completions.c.id.in_(sa.bindparam("ids", expanding=True))
)
_ANSWERS = sa.select(feedback.c.completion_id, feedback.c.accepted, feedback.c.shown).where(
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
                    "shown": ops[i].outcome.shown,
                }
                for cid, i in first.items()
            ]
            inserted = set(conn.execute(_insert_feedback(conn.dialect.name), values).scalars())
        recorded = {i for cid, i in first.items() if cid in inserted}
        later = [i for i, result in enumerate(results) if result is None and i not in recorded]
        stored = {}  # the answer stored first, for ops whose answer was not the one inserted
        if later:
            wanted = sorted({ops[i].outcome.completion_id or "" for i in later})
            stored = {r.completion_id: r for r in conn.execute(_ANSWERS, {"ids": wanted})}
        out: list[Recorded] = []
        for i, op in enumerate(ops):
            done = results[i]
            if done is None:
                row = found[op.outcome.completion_id or ""]
                if i in recorded:
                    done = _recorded("recorded", row.id, row, op.outcome.accepted, op.outcome.shown)
                else:
                    answer = stored[row.id]
                    status: Literal["duplicate", "conflict"] = "duplicate" if _same(answer, op.outcome) else "conflict"
                    done = _recorded(status, row.id, row, answer.accepted, _shown(answer.shown))
            out.append(done)
        return out


def _recorded(status, key: str, row: sa.Row | None, accepted: bool, shown: bool | None) -> Recorded:
    """The answer for an outcome stored (or found) for `key`: with its completion's arm and team when it is ours."""
    if row is None:
        return Recorded(status, key, False, accepted, None, shown)
    return Recorded(status, key, True, accepted, row.arm, shown, loaded(row.arm_team))


def _shown(stored: bool | None) -> bool:
    return stored is not False  # NULL: a row written before `shown` existed, when every outcome was displayed


def _same(stored: sa.Row, outcome: Outcome) -> bool:
    """Is a second outcome for a completion the answer stored first (a retry), not a changed one?"""
    return bool(stored.accepted) == outcome.accepted and _shown(stored.shown) == outcome.shown


BATCHED = (InsertRow, RecordFeedback)  # op kinds the writer runs as one set of statements per group commit
