"""The ingest stage as Prefect tasks (the work is in ``snapshot.write_snapshot`` / ``commit_snapshot``).

The cycle writes the snapshot before training and commits the watermark once training has finished
(see ``snapshot.py``). Retrying either is safe: a cycle that failed before committing its watermark
is finished by the retry, or by the next cycle, with the same snapshot.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.core.config import Params
from tasks.core.store import open_store
from tasks.core.teams import ORG
from tasks.ingest.snapshot import (
    IngestResult,
    PendingIngest,
    commit_snapshot,
    write_snapshot,
)
from tasks.ingest.tracking import ingest_metrics, ingest_tags, snapshot_dataset


@task(name="ingest", retries=2, retry_delay_seconds=[10, 60], cache_policy=NO_CACHE)
def ingest_task(params: Params, repo_dir: Path, now: float | None = None, team: str = ORG) -> PendingIngest:
    """Pull, clean, snapshot and version `team`'s rows of the log store at ``params.paths.database_url``; the
    watermark waits for ``commit_ingest_task``. Logs to MLflow if a run is active (the numbers as metrics, the
    snapshot's path and hashes as tags)."""
    with open_store(params.paths.database_url) as engine:
        pending = write_snapshot(engine, params, Path(repo_dir), time.time() if now is None else now, team)
    if mlflow.active_run():
        mlflow.log_metrics(ingest_metrics(pending.result))
        mlflow.set_tags(ingest_tags(pending.result, Path(repo_dir)))
        dataset = snapshot_dataset(pending.result, Path(repo_dir))
        if dataset is not None:
            mlflow.log_input(dataset, context="training")
    return pending


@task(name="commit-ingest", retries=2, retry_delay_seconds=[10, 60], cache_policy=NO_CACHE)
def commit_ingest_task(params: Params, pending: PendingIngest) -> IngestResult:
    """Advance the watermark past the snapshot (one transaction); logs the final ingest metrics."""
    with open_store(params.paths.database_url) as engine:
        result = commit_snapshot(engine, params, pending)
    if mlflow.active_run():
        mlflow.log_metrics(ingest_metrics(result))
    return result
