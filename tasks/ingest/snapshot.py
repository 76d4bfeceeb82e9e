"""Snapshot: one cycle's clean interactions as a Parquet file, versioned with DVC, then the watermark.

    tabrl ingest                      # pull -> clean -> data/interactions/interactions-<first>-<last>.parquet

Order of work, and why it is exactly-once:

1. pull the decided rows after the committed watermark (``pull.py``), clean them (``clean.py``)
   and stream them into a temporary file;
2. rename it to ``interactions-<first seq>-<last seq>.parquet`` (atomic): the name records the
   cycle's range of completion sequence numbers;
3. ``dvc add`` it and commit the ``.dvc`` file when the project is a DVC (and git) repo, and
   ``dvc push`` it to ``cluster.dvc_remote`` when one is set (the store other hosts reach);
4. in one database transaction: advance the watermark to ``last seq``, record the snapshot and any
   late feedback. A second ingest racing this one fails here instead of double-counting.

Each team's cycle does the same with its own rows, watermark and folder (``data/teams/TEAM/interactions``,
``tasks/core/teams.py``); the organisation's keeps ``data/interactions``.

``run_ingest`` does all four. The cycle splits them: ``write_snapshot`` (1-3) before training and
``commit_snapshot`` (4) once training has finished (a trained candidate, or a guard that stopped
it): a training run that failed, was cancelled or lost its worker leaves the watermark where it
was, exactly like a crash before 4, and the next cycle trains on the same rows again.

A crash before 4 leaves the old watermark and, maybe, a snapshot whose first seq is the watermark
+ 1. The next run finds that file and re-runs exactly its range (every row in it was decided the
first time, and outcomes never depend on when the cycle runs), so the file comes out
byte-identical (same rows in order, same row groups, no timestamps in the file); then it
finishes steps 3 and 4. No row is ever in two snapshots. (One thing can change the re-run: a
user who opted out in between is dropped, and the file is replaced with a warning.)

The Parquet schema is ``tasks.core.schema.INTERACTION_SCHEMA``. The pieces live beside this module: the files
(``parquet.py``), DVC (``versioning.py``), step 4 (``watermark.py``) and MLflow's view (``tracking.py``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow.parquet as pq
from sqlalchemy.engine import Engine

from tasks.core.config import IngestParams, Params
from tasks.core.outcomes import NEVER_SHOWN, taken_chars
from tasks.core.schema import INTERACTION_SCHEMA
from tasks.core.teams import ORG, team_dir
from tasks.ingest.clean import Cleaner
from tasks.ingest.parquet import (
    INCOMING,
    SNAPSHOT_NAME,
    columns,
    crashed_cycle,
    display_path,
    file_sha256,
    fsync_replace,
    snapshot_name,
)
from tasks.ingest.pull import Decided, Watermark, count_after, pull_decided, read_watermark
from tasks.ingest.versioning import IngestError, dvc_md5, version_with_dvc
from tasks.ingest.watermark import advance_watermark
from tasks.sim.users import Summary, merge, summarise

__all__ = [
    "IngestError",
    "IngestResult",
    "PendingIngest",
    "commit_snapshot",
    "file_sha256",
    "run_ingest",
    "write_snapshot",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestResult:
    snapshot: Path | None  # None when fewer than ingest.min_rows clean rows (watermark unchanged)
    sha256: str | None
    rows: int  # rows in the snapshot
    first_seq: int  # completions.seq range the cycle covered (first > last: nothing decided)
    last_seq: int
    watermark: int  # committed watermark after the cycle
    report: dict[str, int]  # cleaning: rows_in, one count per rule, rows_out
    arms: dict[str, Summary]  # outcomes of every decided row by arm (trainable or not), "all" included
    late_feedback: int  # late feedback recorded this cycle
    pending: int  # completions left for later cycles
    dvc: str  # "committed" | "added" (+ ", pushed to REMOTE") | "skipped: <why>" | "" (no snapshot)
    recovered: bool  # this run finished a cycle an earlier run crashed in
    dvc_md5: str | None = None  # DVC's hash of the snapshot (from its .dvc file) when versioned


def snapshot_dir(params: Params, repo_dir: Path, team: str = ORG) -> Path:
    """``<data_dir>/interactions``, a team's ``<data_dir>/teams/TEAM/interactions`` (data_dir relative to the project
    repo unless absolute)."""
    return team_dir(Path(repo_dir) / params.paths.data_dir, team) / "interactions"


@dataclass
class _ArmStats:
    by_arm: dict[str, list[Summary]] = field(default_factory=lambda: defaultdict(list))
    never_shown: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, chunk: list[Decided]) -> None:
        groups: dict[str, tuple[list[str], list[str], list[int]]] = defaultdict(lambda: ([], [], []))
        for d in chunk:
            for arm in (d.arm, "all"):
                if d.outcome in NEVER_SHOWN:
                    self.never_shown[arm][d.outcome] += 1
                    continue
                groups[arm][0].append(d.outcome)
                groups[arm][1].append(d.completion)
                groups[arm][2].append(taken_chars(d.outcome, d.completion, d.accepted_chars))
        for arm, (outcomes, suggestions, taken) in groups.items():
            self.by_arm[arm].append(replace(summarise(outcomes, suggestions), accepted_chars=sum(taken)))

    def result(self) -> dict[str, Summary]:
        arms = sorted(set(self.by_arm) | set(self.never_shown))
        return {arm: replace(merge(self.by_arm.get(arm, [])), **self.never_shown.get(arm, {})) for arm in arms}


@dataclass(frozen=True)
class PendingIngest:
    """Steps 1-3 done, the watermark not yet moved: ``commit_snapshot`` finishes the cycle."""

    result: IngestResult  # as it stands before the commit (old watermark, no late feedback yet)
    old: Watermark
    late: list[dict]  # late feedback of this cycle's rows, recorded by the commit
    shown_path: str  # the snapshot's path as the watermark records it
    now: float
    team: str = ORG  # whose rows and watermark


def run_ingest(engine: Engine, params: Params, repo_dir: Path, now: float, team: str = ORG) -> IngestResult:
    """One ingest cycle of `team`: pull -> clean -> Parquet snapshot -> DVC -> watermark (see the module doc)."""
    return commit_snapshot(engine, params, write_snapshot(engine, params, repo_dir, now, team))


def commit_snapshot(engine: Engine, params: Params, pending: PendingIngest) -> IngestResult:
    """Step 4: advance the watermark past the snapshot (a no-op without one); returns the final result."""
    before = pending.result
    if before.snapshot is None or before.sha256 is None:
        return before
    n_late = advance_watermark(
        engine,
        pending.old,
        before.snapshot,
        before.sha256,
        before.rows,
        before.first_seq,
        before.last_seq,
        pending.late,
        params.ingest,
        pending.now,
        pending.shown_path,
        pending.team,
    )
    with engine.connect() as conn:
        left = count_after(conn, before.last_seq, pending.team)
    return replace(before, watermark=before.last_seq, late_feedback=n_late, pending=left)


@dataclass
class _Pulled:
    """What streaming one cycle's decided rows into the incoming file gathered."""

    cleaner: Cleaner
    last_seq: int  # the last decided row pulled (the watermark when none)
    stats: _ArmStats = field(default_factory=_ArmStats)
    late: list[dict] = field(default_factory=list)
    rows: int = 0  # clean rows written


def _stream(
    engine: Engine, ip: IngestParams, old_seq: int, now: float, upto: int | None, incoming: Path, team: str
) -> _Pulled:
    """Step 1: pull `team`'s decided rows after `old_seq` (up to `upto`), count them by arm, clean them and stream
    the kept ones into `incoming` (no file when none is kept)."""
    pulled = _Pulled(Cleaner(ip), old_seq)
    writer: pq.ParquetWriter | None = None
    try:
        with engine.connect() as conn:
            for chunk in pull_decided(conn, ip, old_seq, now, upto, team):
                if not chunk:
                    continue
                pulled.last_seq = chunk[-1].seq
                pulled.stats.add(chunk)
                pulled.late += [
                    {"completion_id": d.completion_id, "accepted": d.late_accepted}
                    for d in chunk
                    if d.late_accepted is not None
                ]
                chunk = [d for d in chunk if d.outcome not in NEVER_SHOWN]  # never trained on, never cleaned
                mask = pulled.cleaner.keep_mask(
                    [(d.user_id, d.prompt, d.completion, d.trainable, d.opted_out, d.prompt_hash) for d in chunk]
                )
                kept = [d for d, keep in zip(chunk, mask, strict=True) if keep]
                if kept:
                    if writer is None:
                        writer = pq.ParquetWriter(incoming, INTERACTION_SCHEMA, compression="zstd")
                    writer.write_table(columns(kept), row_group_size=ip.chunk_rows)
                    pulled.rows += len(kept)
    finally:
        if writer is not None:
            writer.close()
    return pulled


def _place(incoming: Path, crashed: Path | None, path: Path, sha: str) -> None:
    """Step 2: the incoming file becomes `path`; a crashed cycle's identical file is kept as it is."""
    if crashed is not None and file_sha256(crashed) == sha:
        incoming.unlink()
    else:
        if crashed is not None:
            log.warning(
                "re-run of %s differs from the crashed run's file (a user opted out since?); replacing it", path
            )
        fsync_replace(incoming, path)


def write_snapshot(engine: Engine, params: Params, repo_dir: Path, now: float, team: str = ORG) -> PendingIngest:
    """Steps 1-3 for `team`: pull -> clean -> Parquet snapshot -> DVC, leaving the watermark for
    ``commit_snapshot``."""
    ip = params.ingest
    repo_dir = Path(repo_dir)
    out_dir = snapshot_dir(params, repo_dir, team)
    with engine.connect() as conn:
        old = read_watermark(conn, team)
    crashed = crashed_cycle(out_dir, old.completion_seq)
    upto = int(SNAPSHOT_NAME.match(crashed.name)["last"]) if crashed else None  # type: ignore[index]
    if crashed:
        log.warning("finishing the cycle of %s (its watermark was not committed)", crashed)

    out_dir.mkdir(parents=True, exist_ok=True)
    incoming = out_dir / INCOMING
    pulled = _stream(engine, ip, old.completion_seq, now, upto, incoming, team)
    rows = pulled.rows
    last_seq = upto if upto is not None else pulled.last_seq
    first_seq = old.completion_seq + 1

    def result(path: Path | None, sha: str | None, dvc: str) -> PendingIngest:
        with engine.connect() as conn:
            pending = count_after(conn, old.completion_seq, team)
        before = IngestResult(
            path,
            sha,
            rows if path else 0,
            first_seq,
            last_seq,
            old.completion_seq,
            pulled.cleaner.report,
            pulled.stats.result(),
            0,
            pending,
            dvc,
            crashed is not None,
            dvc_md5(path) if path else None,
        )
        return PendingIngest(
            before, old, pulled.late if path else [], display_path(path, repo_dir) if path else "", now, team
        )

    if rows < ip.min_rows:
        incoming.unlink(missing_ok=True)
        if crashed is not None:  # its rows were all dropped since (opt-outs): nothing left to commit
            log.warning("re-run of %s keeps %d rows < ingest.min_rows; removing it", crashed, rows)
            crashed.unlink()
        log.info(
            "ingest: %d clean rows < ingest.min_rows=%d; no snapshot, watermark stays at %d",
            rows,
            ip.min_rows,
            old.completion_seq,
        )
        return result(None, None, "")

    path = out_dir / snapshot_name(first_seq, last_seq, team)
    sha = file_sha256(incoming)
    _place(incoming, crashed, path, sha)
    return result(path, sha, version_with_dvc(repo_dir, path, params.cluster.dvc_remote))
