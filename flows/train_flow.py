"""train_candidate: the cycle's training step as its own flow, deployed on the `gpu` work pool.

    tabrl deploy                                  # registers it (with the cycle and the A/B decision)
    prefect worker start --pool gpu --type process   # on each GPU host, in any working directory

The cycle (flows/cycle.py, `cluster.train_on: pool`) starts it with `run_deployment` and waits; the
inputs and the candidate move through the MLflow tracking server (flows/remote_training.py), so this
flow runs in whatever directory its worker runs in and reads nothing the cycle wrote to disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.remote_training import TRAIN_FLOW, train_from_references
from tasks.core.config import Params


@flow(name=TRAIN_FLOW, log_prints=True)
def train_candidate(
    run_id: str, snapshot_uri: str, from_uri: str, params: dict[str, Any], base_uri: str | None = None
) -> str:
    """Train the checkpoint at from_uri on the rewarded snapshot at snapshot_uri for the cycle's MLflow
    run_id; params is the cycle's resolved tree. Returns the outcome: `trained` or `diverged`."""
    result = train_from_references(run_id, snapshot_uri, from_uri, Params.model_validate(params), Path.cwd(), base_uri)
    outcome = "trained" if result is not None else "diverged"
    print(f"{outcome}: MLflow run {run_id}")
    return outcome
