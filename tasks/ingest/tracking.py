"""An ingest cycle as MLflow sees it: the snapshot's tags and the cycle's namespaced metrics."""

from __future__ import annotations

from pathlib import Path

from tasks.core import vocab
from tasks.ingest.parquet import display_path
from tasks.ingest.snapshot import IngestResult


def ingest_tags(result: IngestResult, repo_dir: Path) -> dict[str, str]:
    """The snapshot a cycle ingested, as MLflow tags: its path in the repo, sha256 and DVC md5 (when versioned)."""
    if result.snapshot is None or result.sha256 is None:
        return {}
    tags = {vocab.SNAPSHOT: display_path(result.snapshot, repo_dir), vocab.SNAPSHOT_SHA256: result.sha256}
    if result.dvc_md5:
        tags[vocab.SNAPSHOT_DVC_MD5] = result.dvc_md5
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
