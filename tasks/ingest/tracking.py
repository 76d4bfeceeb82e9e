"""An ingest cycle as MLflow sees it: the snapshot's tags, the snapshot as the run's dataset input, and the cycle's
namespaced metrics."""

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


def snapshot_dataset(result: IngestResult, repo_dir: Path):
    """The snapshot as an MLflow dataset (`mlflow.log_input(..., context="training")`: the runs view's Datasets
    column and the run page's inputs): its path as the source, its DVC md5 (else its sha256) as the digest, and
    the interaction schema's columns; only metadata, the file is not read. None without a snapshot."""
    if result.snapshot is None or result.sha256 is None:
        return None
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, Schema

    from tasks.core.schema import INTERACTION_SCHEMA

    columns = Schema([ColSpec("string", name) for name in INTERACTION_SCHEMA.names])
    source = resolve_dataset_source(str(result.snapshot.resolve()))
    name = display_path(result.snapshot, repo_dir)
    return MetaDataset(source, name=name, digest=(result.dvc_md5 or result.sha256)[:32], schema=columns)
