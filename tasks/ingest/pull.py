"""Pull: the completions logged since the committed watermark, each with its decided outcome.

The timeout rule is the core's (``tasks.core.outcomes.outcome_of``): a completion served at
``created_at`` has a deadline (``ingest.feedback_timeout_s`` later, ``ingest.reported_timeout_s`` for a
client that reports its own outcomes). Feedback received by the deadline decides it; none by then means
rejected (not shown, for a reporting client); an empty suggestion is "abstained" whatever the client
says; a completion whose client hung up before the answer is "cancelled". A row whose deadline is still
ahead of ``now`` is not decided yet: the cycle stops before it and the next cycle starts there. Feedback
received after the deadline is *late*: it never changes the outcome (so a re-run computes the same
snapshot), it is recorded in ``late_feedback``. Never-shown rows (cancelled, not shown) are pulled and
counted, never written to a snapshot.

Why the cycle is a contiguous run of sequence numbers, cut at the first undecided row. The
watermark is one number: every completion with ``seq <= watermark`` has been snapshotted. Rows
are streamed in ``seq`` order and the cut stops at the first row that is still young, so nothing
below the watermark is ever left behind. PostgreSQL hands out ``seq`` at insert, not at commit:
an insert still committing is an invisible gap below rows already visible. A gap followed by a
row younger than ``ingest.commit_grace_s`` may be such an insert, so the cut also stops there;
an older gap is a rolled-back insert (nothing will fill it). SQLite commits one writer at a
time, so its sequence has no such gaps.

Each team's cycle pulls its own rows (``in_scope``: the completions its callers were served) past its own
watermark (``tasks/core/teams.py``); the organisation's pulls every row but those of teams that keep their
outcomes to themselves (``teams.shares_with_org``). Another scope's rows leave gaps in a scope's sequence, so the
gaps that may still fill are found in the whole sequence, once per pull (``_horizon``): the first young row whose
predecessor is missing. The cut stops there in every scope.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from tasks.core.config import IngestParams
from tasks.core.outcomes import Outcome, deadline, outcome_of
from tasks.core.store import completions, feedback, teams, users, watermarks
from tasks.core.teams import ORG, watermark_name


@dataclass(frozen=True)
class Watermark:
    completion_seq: int  # every completion with seq <= this is in a snapshot (0: none yet)
    updated_at: float | None  # `now` of the cycle that set it


class Decided(NamedTuple):
    """One completion with its outcome, as the cleaning and snapshot steps see it (a tuple: cheap by the million)."""

    seq: int
    completion_id: str
    created_at: float
    user_id: str
    arm: str
    model_version: str
    prompt: str
    completion: str
    token_ids: str | None  # JSON text as stored (parsed a chunk at a time when written)
    logprobs: str | None
    temperature: float
    outcome: Outcome
    accepted_chars: int | None
    trainable: bool  # False when the client said the outcome is not for training
    opted_out: bool
    late_accepted: bool | None  # the late feedback's verdict, None when there was none
    prompt_hash: str  # sha256(prompt + NUL + completion), as the gateway stored it
    prefix: str  # the text before the cursor, as the editor sent it
    suffix: str


def read_watermark(conn: Connection, team: str = ORG) -> Watermark:
    row = conn.execute(
        sa.select(watermarks.c.completion_seq, watermarks.c.updated_at).where(watermarks.c.name == watermark_name(team))
    ).first()
    return Watermark(0, None) if row is None else Watermark(int(row.completion_seq), row.updated_at)


def in_scope(team: str) -> sa.ColumnElement[bool]:
    """SQL over `completions`: the rows `team`'s cycle trains on. A team's: its callers'. The organisation's:
    every row but those of teams that do not share their outcomes with it (callers without a team included)."""
    c = completions.c
    if team != ORG:
        return c.team == team
    private = sa.select(teams.c.name).where(teams.c.shares_with_org == sa.false())
    return sa.or_(c.team.is_(None), c.team.not_in(private))


def _query(after_seq: int, upto_seq: int | None, team: str) -> sa.Select:
    c, f, u = completions, feedback, users
    stmt = (
        sa.select(
            c.c.seq,
            c.c.id,
            c.c.created_at,
            c.c.user_id,
            c.c.arm,
            c.c.model_version,
            c.c.prompt,
            c.c.completion,
            sa.cast(c.c.token_ids, sa.Text).label("token_ids"),
            sa.cast(c.c.logprobs, sa.Text).label("logprobs"),
            c.c.temperature,
            c.c.abstained,
            f.c.accepted,
            f.c.accepted_chars,
            f.c.received_at,
            f.c.trainable,
            u.c.opted_out,
            c.c.prompt_hash,
            c.c.prefix,
            c.c.suffix,
            c.c.cancelled_at,
            c.c.reports_outcomes,
            f.c.shown,
        )
        .select_from(
            c.outerjoin(f, sa.and_(f.c.completion_id == c.c.id, f.c.matched == sa.true())).outerjoin(
                u, u.c.user_id == c.c.user_id
            )
        )
        .where(c.c.seq > after_seq, in_scope(team))
        .order_by(c.c.seq)
    )
    return stmt if upto_seq is None else stmt.where(c.c.seq <= upto_seq)


def _decided(r: sa.Row, params: IngestParams) -> Decided:
    """One pulled row (columns of `_query`, in order) with its outcome under the timeout rule."""
    outcome, late = outcome_of(
        cancelled=r.cancelled_at is not None,
        abstained=r.abstained,
        reports_outcomes=r.reports_outcomes,
        created_at=r.created_at,
        received_at=r.received_at,
        accepted=r.accepted,
        shown=r.shown,
        ingest=params,
    )
    return Decided(
        r.seq,
        r.id,
        r.created_at,
        r.user_id,
        r.arm,
        r.model_version,
        r.prompt,
        r.completion,
        r.token_ids,
        r.logprobs,
        r.temperature,
        outcome,
        r.accepted_chars if outcome == "accepted" else None,
        r.trainable is not False,
        bool(r.opted_out),
        bool(r.accepted) if late else None,
        r.prompt_hash,
        r.prefix,
        r.suffix,
    )


def pull_decided(
    conn: Connection, params: IngestParams, after_seq: int, now: float, upto_seq: int | None = None, team: str = ORG
) -> Iterator[list[Decided]]:
    """Chunks of `team`'s decided rows with seq > after_seq, in seq order, up to the cut (at most ingest.max_rows).

    With ``upto_seq`` (re-running a cycle whose snapshot was written but whose watermark was not
    advanced) the range is fixed and every row in it is taken: they were all decided then.
    """
    horizon = _horizon(conn, after_seq, now, params.commit_grace_s) if upto_seq is None else None
    result = conn.execution_options(yield_per=params.chunk_rows).execute(_query(after_seq, upto_seq, team))
    taken = 0
    try:
        for part in result.partitions():
            chunk: list[Decided] = []
            for r in part:
                if upto_seq is None:
                    if deadline(r.created_at, r.reports_outcomes, params) > now:
                        yield chunk
                        return  # undecided: this and everything after wait for the next cycle
                    if horizon is not None and r.seq >= horizon:
                        yield chunk
                        return  # behind a gap that may still fill (an insert committing)
                    if params.max_rows is not None and taken == params.max_rows:
                        yield chunk
                        return  # a full snapshot: the rest is the next cycle's
                chunk.append(_decided(r, params))
                taken += 1
            yield chunk
    finally:
        result.close()


def _horizon(conn: Connection, after_seq: int, now: float, grace: float) -> int | None:
    """The first seq after `after_seq`, of any scope, that follows a gap and is younger than `grace`: a gap that may
    be an insert still committing (an older gap is a rolled-back insert). None when there is no such row."""
    row, before = completions.alias("row"), completions.alias("before")
    query = sa.select(sa.func.min(row.c.seq)).where(
        row.c.seq > after_seq + 1,
        row.c.created_at > now - grace,
        ~sa.exists().where(before.c.seq == row.c.seq - 1),
    )
    return conn.execute(query).scalar()


def count_after(conn: Connection, seq: int, team: str = ORG) -> int:
    """`team`'s completions logged after seq (left for later cycles)."""
    query = sa.select(sa.func.count()).select_from(completions).where(completions.c.seq > seq, in_scope(team))
    return conn.execute(query).scalar_one()
