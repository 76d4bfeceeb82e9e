"""Training on the `gpu` work pool: the cycle's side (start the training deployment, wait, read what
it left) and the training flow's side (pull its inputs by reference, train, log the candidate).

The two flows share no disk and no working directory: everything moves through the MLflow
tracking server both hosts reach, under the cycle's run.

* ``snapshot/<name>.parquet``: the rewarded snapshot the update reads (the cycle logs it; the raw
  snapshot is versioned with DVC and pushed to ``cluster.dvc_remote``);
* the starting checkpoint: the champion's immutable ``models:/NAME/VERSION`` URI (a GPU host
  downloads it once into its own ``state/model_cache``);
* ``model/``: the candidate checkpoint the training flow logs, ``train_result.json`` inside it.
  Registering a candidate that passes the gate uploads the same files to the same path, so the
  registry still keeps exactly one copy (tasks/deploy/registry.py);
* tags ``tabrl.train_outcome`` (``trained`` | ``diverged``) and ``tabrl.train_reason``.

A training run that fails, crashes, is cancelled, or does not finish within
``cluster.train_timeout_s`` (a GPU worker that died leaves its run Running for ever: the cycle then
cancels it) raises ``TrainingLost``; the cycle ends with status ``train_failed`` and touches
neither the registry nor the ingest watermark.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelled

from tasks.core import vocab
from tasks.core.config import Params
from tasks.deploy.model_cache import candidate_dir, resolve_model_dir
from tasks.deploy.registry import MODEL_ARTIFACT, Lineage
from tasks.deploy.tracking import CycleRuns
from tasks.train.launch import read_result, train_task
from tasks.train.ppo import TrainingDiverged, TrainResult

TRAIN_FLOW = "train-candidate"  # the flow's name (flows/train_flow.py); its deployment's is cluster.train_deployment
SNAPSHOT_ARTIFACT = "snapshot"


class TrainingLost(RuntimeError):
    """The training run failed, crashed, was cancelled or did not finish in time; the message says which run."""


def train_step(rewarded: Path, lineage: Lineage, params: Params, run_id: str) -> tuple[TrainResult, Path]:
    """Train the champion on the rewarded snapshot here (``cluster.train_on: process``) or on the gpu pool
    (``pool``); returns the result and the candidate's local checkpoint (or adapter) directory. An adapter
    champion trains on its base (`lineage.adapter_base`).

    Raises TrainingDiverged (a guard stopped the update) and, on the pool, TrainingLost."""
    base = lineage.adapter_base
    if params.cluster.train_on == "pool":
        return train_on_pool(rewarded, lineage.champion.uri, params, run_id, base.uri if base else None)
    trained_dir = candidate_dir(params, run_id)
    adapter_base = str(lineage.base_dir) if base else None
    with system_metrics(run_id, params):
        result = train_task(str(rewarded), str(lineage.champion_dir), str(trained_dir), params, None, adapter_base)
    return result, trained_dir


@contextmanager
def system_metrics(run_id: str, params: Params) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network; GPU where pynvml finds one) of this host into the cycle's
    run while it trains, as `system/<host>/...`: the training host's, apart from any other host's. Sampled every
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds (MLflow's default 10)."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, node_id=socket.gethostname(), tracking_uri=params.paths.mlflow_tracking_uri, resume_logging=True
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def train_on_pool(
    rewarded: Path, from_uri: str, params: Params, run_id: str, base_uri: str | None = None
) -> tuple[TrainResult, Path]:
    """Run the training deployment for this cycle's MLflow run, wait for it, and download its candidate.
    base_uri: the base version of an adapter from_uri (the GPU host downloads it too)."""
    cp = params.cluster
    runs = CycleRuns(params)
    runs.log_artifact(run_id, rewarded, SNAPSHOT_ARTIFACT)
    flow_run = run_deployment(
        f"{TRAIN_FLOW}/{cp.train_deployment}",
        parameters={
            "run_id": run_id,
            "snapshot_uri": f"runs:/{run_id}/{SNAPSHOT_ARTIFACT}/{rewarded.name}",
            "from_uri": from_uri,
            "params": params.model_dump(mode="json"),
            "base_uri": base_uri,
        },
        timeout=cp.train_timeout_s,
        poll_interval=cp.train_poll_s,
    )
    state = flow_run.state
    shown = f"training run {flow_run.name!r} ({flow_run.id})"
    if state is None or not state.is_final():
        why = f"{shown} did not finish within cluster.train_timeout_s={cp.train_timeout_s:g} s"
        with get_client(sync_client=True) as prefect:
            prefect.set_flow_run_state(flow_run.id, Cancelled(message=why + "; cancelled by the cycle"), force=True)
        raise TrainingLost(f"{why} (state {state.name if state else None}); cancelled it")
    if not state.is_completed():
        raise TrainingLost(f"{shown} ended {state.name}: {state.message}")
    tags = runs.get(run_id).data.tags
    if tags.get(vocab.TRAIN_OUTCOME) == "diverged":
        raise TrainingDiverged(tags.get(vocab.TRAIN_REASON, ""))
    if tags.get(vocab.TRAIN_OUTCOME) != "trained":
        raise TrainingLost(f"{shown} completed without tagging MLflow run {run_id} {vocab.TRAIN_OUTCOME}=trained")
    downloaded = resolve_model_dir(f"runs:/{run_id}/{MODEL_ARTIFACT}", params)
    return read_result(downloaded), downloaded


def train_from_references(
    run_id: str, snapshot_uri: str, from_uri: str, params: Params, work_dir: Path, base_uri: str | None = None
) -> TrainResult | None:
    """The training flow's work on a GPU host: pull the snapshot and the starting checkpoint from MLflow,
    train in a scratch directory under work_dir, log the candidate as the run's `model` artifact and tag
    the outcome. A guard that stops the update is an outcome (tagged `diverged`, returns None), not a failure.

    work_dir is the flow run's working directory: a fresh one per run from the process worker, or the pool's
    `working_dir` job variable, which then keeps the downloaded models (work_dir/state/model_cache) across runs."""
    here = params.model_copy(update={"paths": params.paths.model_copy(update={"state_dir": str(work_dir / "state")})})
    mlflow.set_tracking_uri(here.paths.mlflow_tracking_uri)  # the update's per-step metrics go to the cycle's run
    runs = CycleRuns(here)
    from_dir = resolve_model_dir(from_uri, here)
    base_dir = str(resolve_model_dir(base_uri, here)) if base_uri else None  # an adapter's base, by its version
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tabrl-train-", dir=work_dir) as tmp:
        snapshot = mlflow.artifacts.download_artifacts(
            artifact_uri=snapshot_uri, dst_path=tmp, tracking_uri=here.paths.mlflow_tracking_uri
        )
        candidate = Path(tmp) / "candidate"
        try:
            with system_metrics(run_id, here):
                result = train_task(
                    snapshot, str(from_dir), str(candidate), here, mlflow_run_id=run_id, base_dir=base_dir
                )
        except TrainingDiverged as err:
            runs.tag(run_id, {vocab.TRAIN_OUTCOME: "diverged", vocab.TRAIN_REASON: str(err)[:5000]})
            return None
        runs.log_artifacts(run_id, candidate, MODEL_ARTIFACT)
    runs.tag(run_id, {vocab.TRAIN_OUTCOME: "trained"})
    return result
