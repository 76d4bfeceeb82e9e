"""Retention: delete logged completions and feedback older than a duration, in batches.

    tabrl purge --older-than 30d [--batch 1000] [--dry-run]

A completion older than the cut goes together with its feedback (whenever that arrived); feedback
older than the cut goes too (unmatched outcomes carry the client's texts). Each batch is its own
transaction, so a purge never holds the store's write lock for long while the gateway logs.
Not the model retention (tasks/deploy/model_retention.py, `tabrl model-retention`), which deletes local
copies of retired model versions on disk.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tasks.core.store import completions, feedback, late_feedback

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*")


class DurationError(ValueError):
    """A duration that is not NUMBER + one of s, m, h, d, w."""


def parse_duration(text: str) -> float:
    """'30d' -> seconds; units s, m, h, d, w."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise DurationError(f"duration {text!r} must be a number and a unit (s, m, h, d, w), e.g. 30d or 12h")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class Purged:
    completions: int
    feedback: int
    late_feedback: int
    cutoff: float  # unix seconds: rows before it were deleted


def purge(
    engine: Engine, older_than_s: float, batch: int = 1000, dry_run: bool = False, now: float | None = None
) -> Purged:
    """Delete completions (with their feedback) and feedback older than older_than_s, batch rows per transaction."""
    if older_than_s <= 0 or batch < 1:
        raise ValueError(f"older_than_s ({older_than_s}) must be > 0 and batch ({batch}) >= 1")
    cutoff = (time.time() if now is None else now) - older_than_s
    old_completions = sa.select(completions.c.seq, completions.c.id).where(completions.c.created_at < cutoff)
    old_feedback = sa.select(feedback.c.seq).where(feedback.c.received_at < cutoff)
    if dry_run:
        with engine.connect() as conn:
            ids = [r.id for r in conn.execute(old_completions)]
            n_fb = conn.execute(
                sa.select(sa.func.count())
                .select_from(feedback)
                .where(
                    sa.or_(
                        feedback.c.received_at < cutoff,
                        feedback.c.completion_id.in_(
                            sa.select(completions.c.id).where(completions.c.created_at < cutoff)
                        ),
                    )
                )
            ).scalar()
            n_late = conn.execute(
                sa.select(sa.func.count()).select_from(late_feedback).where(late_feedback.c.recorded_at < cutoff)
            ).scalar()
        return Purged(len(ids), n_fb, n_late, cutoff)
    n_c = n_f = n_l = 0
    while True:
        with engine.begin() as conn:
            rows = conn.execute(old_completions.order_by(completions.c.seq).limit(batch)).all()
            if not rows:
                break
            ids = [r.id for r in rows]
            n_f += conn.execute(feedback.delete().where(feedback.c.completion_id.in_(ids))).rowcount
            n_c += conn.execute(completions.delete().where(completions.c.seq.in_([r.seq for r in rows]))).rowcount
    while True:
        with engine.begin() as conn:
            seqs = conn.execute(old_feedback.order_by(feedback.c.seq).limit(batch)).scalars().all()
            if not seqs:
                break
            n_f += conn.execute(feedback.delete().where(feedback.c.seq.in_(seqs))).rowcount
    while True:
        with engine.begin() as conn:
            keys = (
                conn.execute(
                    sa.select(late_feedback.c.completion_id).where(late_feedback.c.recorded_at < cutoff).limit(batch)
                )
                .scalars()
                .all()
            )
            if not keys:
                break
            n_l += conn.execute(late_feedback.delete().where(late_feedback.c.completion_id.in_(keys))).rowcount
    return Purged(n_c, n_f, n_l, cutoff)
