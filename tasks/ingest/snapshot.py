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

The Parquet schema is ``tasks.core.schema.INTERACTION_SCHEMA``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import Engine

from tasks.core.config import IngestParams, Params
from tasks.core.schema import INTERACTION_SCHEMA
from tasks.core.store import completions, feedback, late_feedback, snapshots, watermarks
from tasks.ingest.clean import Cleaner
from tasks.ingest.pull import WATERMARK, Decided, Watermark, count_after, pull_decided, read_watermark
from tasks.sim.users import Summary, merge, summarise

log = logging.getLogger(__name__)

SNAPSHOT_NAME = re.compile(r"^interactions-(\d{12})-(\d{12})\.parquet$")
INCOMING = ".incoming.parquet.tmp"


class IngestError(RuntimeError):
    """A cycle that cannot complete (a racing ingest, a failing DVC command); the message says which."""


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


def snapshot_name(first_seq: int, last_seq: int) -> str:
    return f"interactions-{first_seq:012d}-{last_seq:012d}.parquet"


def snapshot_dir(params: Params, repo_dir: Path) -> Path:
    """``<data_dir>/interactions`` (data_dir relative to the project repo unless absolute)."""
    return Path(repo_dir) / params.paths.data_dir / "interactions"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _crashed_cycle(out_dir: Path, watermark: int) -> Path | None:
    """A snapshot that starts right after the watermark: written by a run that did not finish."""
    if not out_dir.is_dir():
        return None
    for path in sorted(out_dir.iterdir()):
        match = SNAPSHOT_NAME.match(path.name)
        if match and int(match.group(1)) == watermark + 1:
            return path
    return None


@dataclass
class _ArmStats:
    by_arm: dict[str, list[Summary]] = field(default_factory=lambda: defaultdict(list))

    def add(self, chunk: list[Decided]) -> None:
        groups: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
        for d in chunk:
            for arm in (d.arm, "all"):
                groups[arm][0].append(d.outcome)
                groups[arm][1].append(d.completion)
        for arm, (outcomes, suggestions) in groups.items():
            self.by_arm[arm].append(summarise(outcomes, suggestions))

    def result(self) -> dict[str, Summary]:
        return {arm: merge(parts) for arm, parts in sorted(self.by_arm.items())}


def _json_lists(texts: list[str | None]) -> list:
    """JSON arrays as stored, parsed in one call per chunk (SQL NULL and JSON null -> None)."""
    return json.loads("[" + ",".join(text if text is not None else "null" for text in texts) + "]")


def _columns(rows: list[Decided]) -> pa.Table:
    cols = list(zip(*rows, strict=True))
    f = Decided._fields
    pick = {
        name: list(cols[f.index(name)])
        for name in (
            "completion_id",
            "created_at",
            "user_id",
            "arm",
            "model_version",
            "prompt",
            "completion",
            "temperature",
            "outcome",
            "accepted_chars",
            "prefix",
            "suffix",
        )
    }
    pick["token_ids"] = _json_lists(cols[f.index("token_ids")])
    pick["logprobs"] = _json_lists(cols[f.index("logprobs")])
    return pa.Table.from_pydict(pick, schema=INTERACTION_SCHEMA).select(INTERACTION_SCHEMA.names)


def _fsync_replace(src: Path, dst: Path) -> None:
    with open(src, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(src, dst)
    dir_fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class PendingIngest:
    """Steps 1-3 done, the watermark not yet moved: ``commit_snapshot`` finishes the cycle."""

    result: IngestResult  # as it stands before the commit (old watermark, no late feedback yet)
    old: Watermark
    late: list[dict]  # late feedback of this cycle's rows, recorded by the commit
    shown_path: str  # the snapshot's path as the watermark records it
    now: float


def run_ingest(engine: Engine, params: Params, repo_dir: Path, now: float) -> IngestResult:
    """One ingest cycle: pull -> clean -> Parquet snapshot -> DVC -> watermark (see the module doc)."""
    return commit_snapshot(engine, params, write_snapshot(engine, params, repo_dir, now))


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
    )
    with engine.connect() as conn:
        left = count_after(conn, before.last_seq)
    return replace(before, watermark=before.last_seq, late_feedback=n_late, pending=left)


def write_snapshot(engine: Engine, params: Params, repo_dir: Path, now: float) -> PendingIngest:
    """Steps 1-3: pull -> clean -> Parquet snapshot -> DVC, leaving the watermark for ``commit_snapshot``."""
    ip = params.ingest
    repo_dir = Path(repo_dir)
    out_dir = snapshot_dir(params, repo_dir)
    with engine.connect() as conn:
        old = read_watermark(conn)
    crashed = _crashed_cycle(out_dir, old.completion_seq)
    upto = int(SNAPSHOT_NAME.match(crashed.name).group(2)) if crashed else None
    if crashed:
        log.warning("finishing the cycle of %s (its watermark was not committed)", crashed)

    cleaner, stats = Cleaner(ip), _ArmStats()
    late: list[dict] = []
    last_seq, rows = old.completion_seq, 0
    out_dir.mkdir(parents=True, exist_ok=True)
    incoming = out_dir / INCOMING
    writer: pq.ParquetWriter | None = None
    try:
        with engine.connect() as conn:
            for chunk in pull_decided(conn, ip, old.completion_seq, now, upto):
                if not chunk:
                    continue
                last_seq = chunk[-1].seq
                stats.add(chunk)
                late += [
                    {"completion_id": d.completion_id, "accepted": d.late_accepted}
                    for d in chunk
                    if d.late_accepted is not None
                ]
                mask = cleaner.keep_mask(
                    [(d.user_id, d.prompt, d.completion, d.trainable, d.opted_out, d.prompt_hash) for d in chunk]
                )
                kept = [d for d, keep in zip(chunk, mask, strict=True) if keep]
                if kept:
                    if writer is None:
                        writer = pq.ParquetWriter(incoming, INTERACTION_SCHEMA, compression="zstd")
                    writer.write_table(_columns(kept), row_group_size=ip.chunk_rows)
                    rows += len(kept)
    finally:
        if writer is not None:
            writer.close()
    last_seq = upto if upto is not None else last_seq
    first_seq = old.completion_seq + 1

    def result(path: Path | None, sha: str | None, dvc: str) -> PendingIngest:
        with engine.connect() as conn:
            pending = count_after(conn, old.completion_seq)
        before = IngestResult(
            path,
            sha,
            rows if path else 0,
            first_seq,
            last_seq,
            old.completion_seq,
            cleaner.report,
            stats.result(),
            0,
            pending,
            dvc,
            crashed is not None,
            dvc_md5(path) if path else None,
        )
        return PendingIngest(before, old, late if path else [], _display_path(path, repo_dir) if path else "", now)

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

    path = out_dir / snapshot_name(first_seq, last_seq)
    sha = file_sha256(incoming)
    if crashed is not None and file_sha256(crashed) == sha:
        incoming.unlink()
    else:
        if crashed is not None:
            log.warning(
                "re-run of %s differs from the crashed run's file (a user opted out since?); replacing it", path
            )
        _fsync_replace(incoming, path)
    return result(path, sha, version_with_dvc(repo_dir, path, params.cluster.dvc_remote))


def _display_path(path: Path, repo_dir: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_dir.resolve()))
    except ValueError:
        return str(path.resolve())


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise IngestError(
            f"`{' '.join(cmd[-3:])}` failed in {cwd} (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return proc


def version_with_dvc(repo_dir: Path, path: Path, remote: str | None = None) -> str:
    """``dvc add`` the snapshot, ``dvc push`` it to `remote` (when given) and commit its .dvc file (only
    those paths); skip with a warning outside DVC."""
    if not (repo_dir / ".dvc").is_dir():
        log.warning("%s is not a DVC repo (no .dvc/): snapshot %s is not versioned", repo_dir, path)
        return f"skipped: {repo_dir} is not a DVC repo"
    try:
        rel = path.resolve().relative_to(repo_dir.resolve())
    except ValueError:
        log.warning("snapshot %s is outside the DVC repo %s: not versioned", path, repo_dir)
        return f"skipped: {path} is outside {repo_dir}"
    _run([sys.executable, "-m", "dvc", "add", "-q", str(rel)], repo_dir)
    if remote is not None:  # before the commit: a committed .dvc file always has its data in the remote
        _run([sys.executable, "-m", "dvc", "push", "-q", "-r", remote, str(rel) + ".dvc"], repo_dir)
    pushed = f", pushed to {remote}" if remote is not None else ""
    if not (repo_dir / ".git").exists():
        return "added" + pushed
    tracked = [str(rel) + ".dvc", str(rel.parent / ".gitignore")]
    _run(["git", "add", "--", *tracked], repo_dir)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet", "--", *tracked], cwd=repo_dir)
    if staged.returncode == 1:
        _run(["git", "commit", "-q", "-m", f"ingest: snapshot {rel.name}", "--", *tracked], repo_dir)
    return "committed" + pushed


def dvc_md5(path: Path) -> str | None:
    """The md5 DVC recorded for `path` in `path.dvc` (what `dvc checkout` restores), None when not versioned."""
    meta = path.with_name(path.name + ".dvc")
    if not meta.is_file():
        return None
    outs = yaml.safe_load(meta.read_text()).get("outs") or [{}]
    md5 = outs[0].get("md5")
    return str(md5) if md5 else None


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
) -> int:
    """One transaction: watermark -> last_seq (only if still `old`), the snapshot record, late feedback.

    Returns the late feedback recorded: this cycle's rows, plus feedback that arrived since the
    last cycle for rows of earlier snapshots.
    """
    with engine.begin() as conn:
        values = {"completion_seq": last_seq, "snapshot": shown_path, "snapshot_sha256": sha, "updated_at": now}
        if old.updated_at is None:
            conn.execute(watermarks.insert().values(name=WATERMARK, **values))
        else:
            moved = conn.execute(
                watermarks.update()
                .where(watermarks.c.name == WATERMARK, watermarks.c.completion_seq == old.completion_seq)
                .values(**values)
            )
            if moved.rowcount != 1:
                raise IngestError(
                    f"the ingest watermark moved from {old.completion_seq} during this cycle: "
                    "another ingest ran at the same time; this cycle's snapshot is not committed"
                )
        conn.execute(
            snapshots.insert().values(
                name=path.name, first_seq=first_seq, last_seq=last_seq, rows=rows, sha256=sha, created_at=now
            )
        )
        records = [{**item, "snapshot": path.name, "recorded_at": now} for item in late]
        if old.updated_at is not None:
            records += _late_for_earlier_snapshots(conn, old, params, now)
        if records:
            conn.execute(late_feedback.insert(), records)
    return len(records)


def _late_for_earlier_snapshots(conn, old: Watermark, params: IngestParams, now: float) -> list[dict]:
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
            f.c.matched == sa.true(),
            c.c.abstained == sa.false(),
            c.c.seq <= old.completion_seq,
            f.c.received_at >= old.updated_at - params.commit_grace_s,
            f.c.received_at > c.c.created_at + params.feedback_timeout_s,
        )
        .order_by(f.c.completion_id)
    )
    return [
        {"completion_id": r.completion_id, "accepted": r.accepted, "snapshot": r.name, "recorded_at": now}
        for r in conn.execute(stmt)
    ]


def ingest_tags(result: IngestResult, repo_dir: Path) -> dict[str, str]:
    """The snapshot a cycle ingested, as MLflow tags: its path in the repo, sha256 and DVC md5 (when versioned)."""
    if result.snapshot is None or result.sha256 is None:
        return {}
    tags = {"tabrl.snapshot": _display_path(result.snapshot, repo_dir), "tabrl.snapshot_sha256": result.sha256}
    if result.dvc_md5:
        tags["tabrl.snapshot_dvc_md5"] = result.dvc_md5
    return tags


def ingest_metrics(result: IngestResult) -> dict[str, float]:
    """Namespaced numbers of a cycle, for MLflow."""
    metrics = {
        "ingest/rows": result.rows,
        "ingest/late_feedback": result.late_feedback,
        "ingest/pending": result.pending,
        "ingest/watermark": result.watermark,
    }
    metrics.update({f"ingest/clean/{key}": value for key, value in result.report.items()})
    return {key: float(value) for key, value in metrics.items()}
