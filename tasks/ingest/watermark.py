"""Step 4 of an ingest cycle: one transaction moves the watermark past the snapshot (only if no other ingest
moved it), records the snapshot and the late feedback."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tasks.core.config import IngestParams
from tasks.core.outcomes import deadline_sql
from tasks.core.store import completions, feedback, late_feedback, snapshots, watermarks
from tasks.core.teams import ORG, scope_is, stored, watermark_name
from tasks.ingest.pull import Watermark, in_scope
from tasks.ingest.versioning import IngestError


def advance_watermark(
    engine: Engine,
    old: Watermark,
    path: Path,
    sha: str,
    rows: int,
    first_seq: int,
    last_seq: int,
    late: list[dict],
    params: IngestParams,
    now: float,
    shown_path: str,
    team: str = ORG,
) -> int:
    """One transaction: `team`'s watermark -> last_seq (only if still `old`), the snapshot record, late feedback.

    Returns the late feedback recorded: this cycle's rows, plus feedback that arrived since the
    last cycle for rows of earlier snapshots. A completion is in one snapshot of each scope that trains on it (its
    team's, the organisation's); its late feedback is recorded once, with the first of them.
    """
    name = watermark_name(team)
    with engine.begin() as conn:
        values = {"completion_seq": last_seq, "snapshot": shown_path, "snapshot_sha256": sha, "updated_at": now}
        if old.updated_at is None:
            conn.execute(watermarks.insert().values(name=name, **values))
        else:
            moved = conn.execute(
                watermarks.update()
                .where(watermarks.c.name == name, watermarks.c.completion_seq == old.completion_seq)
                .values(**values)
            )
            if moved.rowcount != 1:
                raise IngestError(
                    f"the ingest watermark moved from {old.completion_seq} during this cycle: "
                    "another ingest ran at the same time; this cycle's snapshot is not committed"
                )
        conn.execute(
            snapshots.insert().values(
                name=path.name,
                first_seq=first_seq,
                last_seq=last_seq,
                rows=rows,
                sha256=sha,
                created_at=now,
                team=stored(team),
            )
        )
        records = [{**item, "snapshot": path.name, "recorded_at": now} for item in late]
        if old.updated_at is not None:
            records += _late_for_earlier_snapshots(conn, old, params, now, team)
        records = _not_recorded(conn, records)  # another scope's cycle may have recorded some
        if records:
            conn.execute(late_feedback.insert(), records)
    return len(records)


def _not_recorded(conn, records: list[dict]) -> list[dict]:
    """The late feedback of `records` that the late_feedback table does not hold yet."""
    ids = [r["completion_id"] for r in records]
    query = sa.select(late_feedback.c.completion_id).where(late_feedback.c.completion_id.in_(ids))
    known = set(conn.execute(query).scalars()) if ids else set()
    return [r for r in records if r["completion_id"] not in known]


def _late_for_earlier_snapshots(conn, old: Watermark, params: IngestParams, now: float, team: str) -> list[dict]:
    """Feedback received after its deadline for rows already snapshotted, not recorded yet.

    Only feedback received since the previous cycle (less the commit grace) can be new, which
    keeps this an index range instead of a scan of all feedback ever.
    """
    c, f, s, lf = completions, feedback, snapshots, late_feedback
    stmt = (
        sa.select(f.c.completion_id, f.c.accepted, s.c.name)
        .select_from(
            f.join(c, c.c.id == f.c.completion_id)
            .join(s, sa.and_(c.c.seq >= s.c.first_seq, c.c.seq <= s.c.last_seq))
            .outerjoin(lf, lf.c.completion_id == f.c.completion_id)
        )
        .where(
            lf.c.completion_id.is_(None),
            scope_is(s.c.team, team),
            in_scope(team),
            f.c.matched == sa.true(),
            c.c.abstained == sa.false(),
            c.c.cancelled_at.is_(None),
            c.c.seq <= old.completion_seq,
            f.c.received_at >= old.updated_at - params.commit_grace_s,
            f.c.received_at > deadline_sql(c.c.created_at, c.c.reports_outcomes, params),  # late
        )
        .order_by(f.c.completion_id)
    )
    return [
        {"completion_id": r.completion_id, "accepted": r.accepted, "snapshot": r.name, "recorded_at": now}
        for r in conn.execute(stmt)
    ]
