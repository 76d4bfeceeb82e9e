"""The MLflow tracking side of deploy: experiments and one run per cycle, named for its outcome.

* Every cycle, a skipped one too, is one MLflow run in experiment ``deploy.experiment``: the full
  resolved params (as MLflow params, and untruncated as the artifact ``params.json``), the metrics
  every stage logs into the active run, the snapshot's path and hashes (sha256, DVC md5) as tags. It
  is numbered and, once its outcome is known, named for it (`cycle 3 · deployed · tabrl-completion/4`,
  `cycle 4 · skipped: challenger under test`) with the status, reason and version as tags: the runs
  list tells the story.
* tabrl's experiments carry ``mlflow.experimentKind = custom_model_development`` and a description.
  MLflow 3.17's UI reads the kind only where its global GenAI / Model training switch is off, so
  :meth:`CycleRuns.runs_view_url` sets the switch in the link that opens the runs.

The registered model and its versions built from these runs are in ``registry.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow import MlflowClient
from mlflow.entities import Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from tasks.core import vocab
from tasks.core.config import Params
from tasks.core.teams import ORG, scoped
from tasks.deploy.errors import DeployError

KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # what the MLflow UI shows as an experiment's or a run's description
CYCLES_DESCRIPTION = (
    "tabrl online RL: one run per cycle (ingest -> reward -> train -> evaluate -> register -> rollout), "
    "named `cycle N · status · version`; the tags say why (tabrl.cycle_reason) and on which snapshot "
    "(tabrl.snapshot_dvc_md5). Select runs and Compare to see how the cycles' metrics move."
)
MAX_RUN_NAME_LENGTH = 250


def tracking_client(params: Params) -> MlflowClient:
    """A client on `paths.mlflow_tracking_uri`; a SQLite store's directory is created first."""
    uri = params.paths.mlflow_tracking_uri
    if uri.startswith("sqlite:///"):
        db_path = uri[len("sqlite:///") :]
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: MlflowClient, name: str, params: Params, description: str) -> str:
    """The id of experiment `name`, created on first use with its kind and `description`.

    The kind tag marks it as model training, not GenAI (MLflow's UI reads it where its global GenAI /
    Model training switch is off: see :meth:`CycleRuns.runs_view_url`); an experiment that lacks it (made by an
    older tabrl or by hand) gets it.
    With a local tracking store the artifacts go under `<paths.state_dir>/mlartifacts` (MLflow's own
    default is ./mlruns of whatever the working directory is); a tracking server decides for itself.
    """
    found = client.get_experiment_by_name(name)
    if found is not None:
        if KIND_TAG not in found.tags:
            client.set_experiment_tag(found.experiment_id, KIND_TAG, EXPERIMENT_KIND)
        return found.experiment_id
    location = None
    if _is_local_store(params.paths.mlflow_tracking_uri):
        location = (Path(params.paths.state_dir) / "mlartifacts").resolve().as_uri()
    tags = {KIND_TAG: EXPERIMENT_KIND, NOTE_TAG: description}
    return client.create_experiment(name, artifact_location=location, tags=tags)


def _is_local_store(tracking_uri: str) -> bool:
    return urlparse(tracking_uri).scheme in ("", "file", "sqlite")


# --- cycle runs -----------------------------------------------------------------------------------


class CycleRuns:
    """The cycle runs of experiment `deploy.experiment` (a team's: `deploy.experiment`.TEAM): started, tagged, named
    for their outcome, ended; through one MLflow client on `paths.mlflow_tracking_uri`."""

    def __init__(self, params: Params, team: str = ORG) -> None:
        self.params = params
        self.team = team
        self.experiment = scoped(params.deploy.experiment, team)  # a team's cycles count and gate on their own
        self.client = tracking_client(params)

    def experiment_id(self) -> str:
        """The cycles experiment's id, created on first use (see :func:`experiment_id`)."""
        return experiment_id(self.client, self.experiment, self.params, CYCLES_DESCRIPTION)

    def start(
        self,
        *,
        run_id: str | None = None,
        snapshot_sha256: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """Start the cycle's MLflow run (or resume `run_id`) with the full resolved params; returns the run id.

        A new cycle run (tag `tabrl.kind` = cycle) gets the next cycle number (tag `tabrl.cycle`) and the
        name `cycle N` until :meth:`name_outcome` tells its outcome. Resuming a run checks that its
        logged params are the ones given (a cycle resumed under another config would no longer be
        comparable) and logs any that a crash left out.
        """
        all_tags = {vocab.KIND: "cycle", vocab.TEAM: self.team, **(tags or {})}
        if snapshot_sha256 is not None:
            all_tags[vocab.SNAPSHOT_SHA256] = snapshot_sha256
        wanted = mlflow_params(self.params)
        if run_id is None:
            exp = self.experiment_id()
            if all_tags[vocab.KIND] == "cycle":
                number = self._last_cycle_number(exp) + 1
                all_tags[vocab.CYCLE] = str(number)
                run_name = run_name or f"cycle {number}"
            run_id = self.client.create_run(exp, run_name=run_name, tags=all_tags).info.run_id
            missing = wanted
            self.client.log_dict(run_id, self.params.model_dump(mode="json"), "params.json")
        else:
            missing = self._resume(run_id, wanted)
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in all_tags.items()])
        items = [Param(k, v) for k, v in missing.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        return run_id

    def _resume(self, run_id: str, wanted: dict[str, str]) -> dict[str, str]:
        """Mark run `run_id` running again, once its logged params are shown to be `wanted`; returns those missing."""
        run = self.get(run_id)
        logged = run.data.params
        differ = sorted(k for k, v in wanted.items() if k in logged and logged[k] != v)
        if differ:
            shown = ", ".join(f"{k}: {logged[k]!r} -> {wanted[k]!r}" for k in differ[:5])
            raise DeployError(
                f"cannot resume MLflow run {run_id} with different params ({shown}); start a new cycle run"
            )
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        return {k: v for k, v in wanted.items() if k not in logged}

    def _last_cycle_number(self, experiment: str) -> int:
        """The number of the latest cycle run in the experiment, 0 before the first.

        Cycles run one at a time (one flow, one schedule); two started in the same instant would share a number.
        """
        runs = self.client.search_runs(
            [experiment], "tags.`tabrl.kind` = 'cycle'", order_by=["attributes.start_time DESC"], max_results=1
        )
        return int(runs[0].data.tags.get(vocab.CYCLE, "0")) if runs else 0

    def get(self, run_id: str) -> Run:
        """The run `run_id`; a DeployError naming the store when there is none."""
        return get_run(self.client, run_id)

    def tag(self, run_id: str, values: Mapping[str, Any]) -> None:
        """Set tags on the run from plain values (within MLflow's limits)."""
        self.client.log_batch(run_id, tags=as_flat_tags(values))

    def rename(self, run_id: str, name: str) -> None:
        self.client.update_run(run_id, name=name)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str) -> None:
        """Log one file into the run's artifacts under `artifact_path`."""
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, folder: str | Path, artifact_path: str) -> None:
        """Log a directory's files into the run's artifacts under `artifact_path`."""
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def gated(self, max_results: int = 10_000) -> list[Run]:
        """The cycle runs whose gate typed a window of held-out regions (their `tabrl.gate_window` tag), newest
        first; none before the experiment exists."""
        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is None:
            return []
        return self.client.search_runs(
            [experiment.experiment_id],
            f"tags.`{vocab.GATE_WINDOW}` LIKE '%'",
            order_by=["attributes.start_time DESC"],
            max_results=max_results,
        )

    def next_gate_window(self, windows: int) -> int:
        """The window of held-out regions the next gate types (`tasks.sim.acceptance.gate_regions`): the one after
        the last gated cycle's (its `tabrl.gate_window` tag), round the `windows`; 0 before the first gate. Counted
        by gates, not cycles: skipped cycles do not make two gates in a row type the same window."""
        runs = self.gated(max_results=1)
        return (int(runs[0].data.tags[vocab.GATE_WINDOW]) + 1) % windows if runs else 0

    def name_outcome(self, run_id: str, status: str, reason: str, version: str | None = None) -> str:
        """Tell the cycle's outcome on its run: the name (see :func:`cycle_run_name`) and the tags
        `tabrl.cycle_status`, `tabrl.cycle_reason` and, when one was registered, `tabrl.version`; returns the name."""
        cycle = self.get(run_id).data.tags.get(vocab.CYCLE, "?")
        name = cycle_run_name(cycle, status, reason, version)
        tags = {vocab.CYCLE_STATUS: status, vocab.CYCLE_REASON: reason}
        if version:
            tags[vocab.VERSION] = version
        self.tag(run_id, tags)
        self.rename(run_id, name)
        return name

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        """Close the cycle run: FINISHED, FAILED or KILLED."""
        self.client.set_terminated(run_id, status=status)

    def runs_view_url(self, ui_url: str) -> str:
        """The link that opens the cycles experiment on its runs in the MLflow UI served at `ui_url`.

        MLflow 3.17's UI picks its GenAI or "Model training" views with one global switch (the link's
        `workflowType`, else the browser's last choice, GenAI at first); it reads the experiment's kind
        tag only where that switch is off. The link sets the switch, so the runs show at once.
        """
        return f"{ui_url.rstrip('/')}/#/experiments/{self.experiment_id()}/runs?workflowType=machine_learning"


def cycle_run_name(cycle: str, status: str, reason: str, version: str | None) -> str:
    """`cycle 3 · deployed · tabrl-completion/4`, `cycle 4 · skipped: challenger under test`, `cycle 5 · diverged`.

    A skip says why in a few words (the reason up to its first parenthesis); the full reason is a tag.
    """
    name = f"cycle {cycle} · {status.replace('_', ' ')}"
    if status == "skipped":
        name += f": {reason.split(' (', 1)[0]}"
    if version:
        name += f" · {version}"
    return name[:MAX_RUN_NAME_LENGTH]


def mlflow_params(params: Params) -> dict[str, str]:
    """params.flat() as MLflow param strings, within MLflow's key and value length limits.

    A value longer than the limit keeps its head and ends in its sha256, so two different long values
    never log the same string; the untruncated tree is the run's `params.json` artifact.
    """
    out = {}
    for key, value in params.flat().items():
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        out[_fit(key, MAX_ENTITY_KEY_LENGTH)] = _fit(text, MAX_PARAM_VAL_LENGTH)
    return out


def _fit(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    tail = f"...[sha256:{hashlib.sha256(text.encode()).hexdigest()}]"
    return text[: limit - len(tail)] + tail


def get_run(client: MlflowClient, run_id: str) -> Run:
    """The run `run_id`; a DeployError naming the store when there is none."""
    try:
        return client.get_run(run_id)
    except MlflowException as err:
        if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise DeployError(f"MLflow run {run_id} not found in {client.tracking_uri}") from err
        raise


def as_flat_tags(values: Mapping[str, Any]) -> list[RunTag]:
    """MLflow tags from plain values (within the tag value limit)."""
    return [RunTag(_fit(k, MAX_ENTITY_KEY_LENGTH), _fit(str(v), MAX_PARAM_VAL_LENGTH)) for k, v in values.items()]
