"""The ingest stage as a Prefect task (the work is in ``snapshot.run_ingest``).

Retrying is safe: a cycle that failed before committing its watermark is finished by the retry
with the same snapshot (see ``snapshot.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from serving.store import open_store
from tasks.config import Params
from tasks.ingest.snapshot import IngestResult, ingest_metrics, ingest_tags, run_ingest


@task(name="ingest", retries=2, retry_delay_seconds=[10, 60], cache_policy=NO_CACHE)
def ingest_task(params: Params, repo_dir: Path, now: float | None = None) -> IngestResult:
    """Pull, clean and snapshot the log store of ``params.paths.database_url``; log to MLflow if a run is active
    (the numbers as metrics, the snapshot's path and hashes as tags)."""
    with open_store(params.paths.database_url) as engine:
        result = run_ingest(engine, params, Path(repo_dir), time.time() if now is None else now)
    if mlflow.active_run():
        mlflow.log_metrics(ingest_metrics(result))
        mlflow.set_tags(ingest_tags(result, Path(repo_dir)))
    return result
