"""Snapshot files: their names (the range of completion sequence numbers), rows as Parquet columns, the
durable rename, hashes, and the file a crashed cycle left behind (`tasks/ingest/snapshot.py` runs the cycle)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow as pa

from tasks.core.schema import INTERACTION_SCHEMA
from tasks.core.teams import ORG
from tasks.ingest.pull import Decided

# interactions-[TEAM-]FIRST-LAST.parquet: a team's snapshots carry its name (the snapshots table keys them by file
# name, and a team's range of seqs may equal the organisation's)
SNAPSHOT_NAME = re.compile(
    r"^interactions-(?:(?P<team>[a-z0-9][a-z0-9_-]*)-)?(?P<first>\d{12})-(?P<last>\d{12})\.parquet$"
)
INCOMING = ".incoming.parquet.tmp"


def snapshot_name(first_seq: int, last_seq: int, team: str = ORG) -> str:
    scope = "" if team == ORG else f"{team}-"
    return f"interactions-{scope}{first_seq:012d}-{last_seq:012d}.parquet"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def crashed_cycle(out_dir: Path, watermark: int) -> Path | None:
    """A snapshot that starts right after the watermark: written by a run that did not finish."""
    if not out_dir.is_dir():
        return None
    for path in sorted(out_dir.iterdir()):
        match = SNAPSHOT_NAME.match(path.name)
        if match and int(match["first"]) == watermark + 1:
            return path
    return None


def _json_lists(texts: list[str | None]) -> list:
    """JSON arrays as stored, parsed in one call per chunk (SQL NULL and JSON null -> None)."""
    return json.loads("[" + ",".join(text if text is not None else "null" for text in texts) + "]")


def columns(rows: list[Decided]) -> pa.Table:
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


def fsync_replace(src: Path, dst: Path) -> None:
    with open(src, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(src, dst)
    dir_fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def display_path(path: Path, repo_dir: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_dir.resolve()))
    except ValueError:
        return str(path.resolve())
