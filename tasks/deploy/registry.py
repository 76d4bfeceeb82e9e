"""The MLflow side of deploy: one run per cycle, one registered model, aliases, local model dirs.

* Every cycle, a skipped one too, is one MLflow run in experiment ``deploy.experiment``: the full
  resolved params (as MLflow params, and untruncated as the artifact ``params.json``), the metrics
  every stage logs, the snapshot's path and hashes (sha256, DVC md5) as tags. It is numbered and, once
  its outcome is known, named for it (`cycle 3 · deployed · tabrl-completion/4`, `cycle 4 · skipped:
  challenger under test`) with the status, reason and version as tags: the runs list tells the story.
* tabrl's experiments carry ``mlflow.experimentKind = custom_model_development`` and a description, so
  MLflow 3's UI opens them on their runs rather than on its (empty) GenAI views.
* A candidate checkpoint (a Hugging Face directory) becomes a new version of ``deploy.registered_model``.
  MLflow 3.17's ``register_model('runs:/..')`` refuses plain folders (it wants an MLmodel file), so the
  folder is logged once as the run's ``model`` artifact and the version is created by reference to it
  with ``MlflowClient.create_model_version(source=<run artifact uri>/model)``. The version's
  description links its run, its snapshot and the gate's numbers; the A/B decision adds its own.
* Aliases ``champion`` (serves 100 % unless a test runs) and ``challenger`` (under A/B test).

Copies of big checkpoints: the registry holds exactly one immutable copy, the run artifact (the
trainer's output directory is scratch that the next cycle may overwrite, so a reference to it would
not be reproducible). Registering a version adds no copy (the version points at the artifact).
Resolving ``models:/NAME@alias`` on a local artifact store (a SQLite or file tracking URI, artifacts
under ``paths.state_dir``) returns the artifact directory itself, no copy; on a remote store (an
``mlflow server``, S3, ...) it downloads once into ``<state_dir>/model_cache/NAME/VERSION`` and
reuses that (versions are immutable, so the cache never goes stale).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from serving.store import CHAMPION
from tasks.config import Params

MODEL_ARTIFACT = "model"
KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # what the MLflow UI shows as an experiment's or a run's description
CYCLES_DESCRIPTION = (
    "tabrl online RL: one run per cycle (ingest -> reward -> train -> evaluate -> register -> rollout), "
    "named `cycle N · status · version`; the tags say why (tabrl.cycle_reason) and on which snapshot "
    "(tabrl.snapshot_dvc_md5). Select runs and Compare to see how the cycles' metrics move."
)
CYCLE_TAG = "tabrl.cycle"  # the cycle's number, 1 for the first cycle run of the experiment
MAX_RUN_NAME_LENGTH = 250
SNAPSHOT_TAGS = ("tabrl.snapshot", "tabrl.snapshot_sha256", "tabrl.snapshot_dvc_md5")  # copied onto its version
CACHE_DONE = ".tabrl-complete"  # written last into a downloaded model dir; a dir without it is partial


class DeployError(RuntimeError):
    """The registry or the arms are not in a state that allows the step; the message says why and what to do."""


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: int
    source: str  # artifact URI of the checkpoint directory
    run_id: str | None  # the cycle run that produced it

    @property
    def uri(self) -> str:
        """`models:/NAME/VERSION`, immutable (an alias URI moves)."""
        return f"models:/{self.name}/{self.version}"

    @property
    def label(self) -> str:
        """`NAME/VERSION`: what arms and completions record as their model version."""
        return f"{self.name}/{self.version}"


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

    The kind tag makes MLflow 3's UI open the experiment on its runs ("Model training") instead of
    the empty GenAI views; an experiment that lacks it (made by an older tabrl or by hand) gets it.
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


def runs_view_url(params: Params, ui_url: str) -> str:
    """The link that opens the cycles experiment on its runs in the MLflow UI served at `ui_url`.

    MLflow 3.17's UI picks its GenAI or "Model training" views with one global switch (the link's
    `workflowType`, else the browser's last choice, GenAI at first); it reads the experiment's kind
    tag only where that switch is off. The link sets the switch, so the runs show at once.
    """
    exp = experiment_id(tracking_client(params), params.deploy.experiment, params, CYCLES_DESCRIPTION)
    return f"{ui_url.rstrip('/')}/#/experiments/{exp}/runs?workflowType=machine_learning"


def _is_local_store(tracking_uri: str) -> bool:
    return urlparse(tracking_uri).scheme in ("", "file", "sqlite")


# --- cycle runs -----------------------------------------------------------------------------------


def start_cycle_run(
    params: Params,
    *,
    run_id: str | None = None,
    snapshot_sha256: str | None = None,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> str:
    """Start the cycle's MLflow run (or resume `run_id`) with the full resolved params; returns the run id.

    A new cycle run (tag `tabrl.kind` = cycle) gets the next cycle number (tag `tabrl.cycle`) and the
    name `cycle N` until :func:`name_cycle_run` tells its outcome. Resuming a run checks that its
    logged params are the ones given (a cycle resumed under another config would no longer be
    comparable) and logs any that a crash left out.
    """
    client = tracking_client(params)
    all_tags = {"tabrl.kind": "cycle", **(tags or {})}
    if snapshot_sha256 is not None:
        all_tags["tabrl.snapshot_sha256"] = snapshot_sha256
    wanted = mlflow_params(params)
    if run_id is None:
        exp = experiment_id(client, params.deploy.experiment, params, CYCLES_DESCRIPTION)
        if all_tags["tabrl.kind"] == "cycle":
            number = _last_cycle_number(client, exp) + 1
            all_tags[CYCLE_TAG] = str(number)
            run_name = run_name or f"cycle {number}"
        run_id = client.create_run(exp, run_name=run_name, tags=all_tags).info.run_id
        missing = wanted
        client.log_dict(run_id, params.model_dump(mode="json"), "params.json")
    else:
        run = _get_run(client, run_id)
        logged = run.data.params
        differ = sorted(k for k, v in wanted.items() if k in logged and logged[k] != v)
        if differ:
            shown = ", ".join(f"{k}: {logged[k]!r} -> {wanted[k]!r}" for k in differ[:5])
            raise DeployError(
                f"cannot resume MLflow run {run_id} with different params ({shown}); start a new cycle run"
            )
        missing = {k: v for k, v in wanted.items() if k not in logged}
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in all_tags.items()])
    items = [Param(k, v) for k, v in missing.items()]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])
    return run_id


def _last_cycle_number(client: MlflowClient, experiment: str) -> int:
    """The number of the latest cycle run in the experiment, 0 before the first.

    Cycles run one at a time (one flow, one schedule); two started in the same instant would share a number.
    """
    runs = client.search_runs(
        [experiment], "tags.`tabrl.kind` = 'cycle'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return int(runs[0].data.tags.get(CYCLE_TAG, "0")) if runs else 0


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


def name_cycle_run(params: Params, run_id: str, status: str, reason: str, version: str | None = None) -> str:
    """Tell the cycle's outcome on its run: the name (see :func:`cycle_run_name`) and the tags
    `tabrl.cycle_status`, `tabrl.cycle_reason` and, when one was registered, `tabrl.version`; returns the name."""
    client = tracking_client(params)
    cycle = _get_run(client, run_id).data.tags.get(CYCLE_TAG, "?")
    name = cycle_run_name(cycle, status, reason, version)
    tags = {"tabrl.cycle_status": status, "tabrl.cycle_reason": reason}
    if version:
        tags["tabrl.version"] = version
    client.log_batch(run_id, tags=as_flat_tags(tags))
    client.update_run(run_id, name=name)
    return name


def end_cycle_run(params: Params, run_id: str, status: str = "FINISHED") -> None:
    """Close the cycle run: FINISHED, FAILED or KILLED."""
    tracking_client(params).set_terminated(run_id, status=status)


def log_cycle_metrics(params: Params, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log a stage's metrics (namespaced names, e.g. `train/loss`) to the cycle run in batches."""
    items = [Metric(k, float(v), int(time.time() * 1000), step or 0) for k, v in metrics.items()]
    client = tracking_client(params)
    for start in range(0, len(items), 1000):  # MLflow's batch limit for metrics
        client.log_batch(run_id, metrics=items[start : start + 1000])


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


def _get_run(client: MlflowClient, run_id: str):
    try:
        return client.get_run(run_id)
    except MlflowException as err:
        if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise DeployError(f"MLflow run {run_id} not found in {client.tracking_uri}") from err
        raise


# --- registered model versions and aliases ---------------------------------------------------------


def register_candidate(
    model_dir: str | Path,
    params: Params,
    run_id: str,
    tags: Mapping[str, str] | None = None,
    *,
    gate: Mapping[str, float] | None = None,
) -> ModelVersion:
    """Log a checkpoint directory as the run's `model` artifact and register it as a new version.

    The one copy the registry keeps is this artifact; the version refers to it. Its description
    links the run, names the snapshot it was trained on and, given `gate` (the numbers of the gate it
    passed, `GateDecision.numbers`), shows what the gate compared.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DeployError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json)")
    client = tracking_client(params)
    run = _get_run(client, run_id)
    client.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACT)
    name = params.deploy.registered_model
    _ensure_registered_model(client, name)
    version_tags = {"tabrl.cycle_run_id": run_id, **(tags or {})}
    for key in SNAPSHOT_TAGS:
        if run.data.tags.get(key):
            version_tags[key] = run.data.tags[key]
    mv = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri}/{MODEL_ARTIFACT}",
        run_id=run_id,
        tags=version_tags,
        description=version_description(run, gate),
    )
    return _version(mv)


def version_description(run: Run, gate: Mapping[str, float] | None) -> str:
    """Markdown for a version's page in the MLflow UI: its run (a link), its snapshot, the gate's numbers."""
    tags = run.data.tags
    link = f"[{run.info.run_name or run.info.run_id}](#/experiments/{run.info.experiment_id}/runs/{run.info.run_id})"
    lines = [f"Trained in run {link} (run id `{run.info.run_id}`)."]
    if tags.get("tabrl.snapshot"):
        lines.append(
            f"Snapshot `{tags['tabrl.snapshot']}`: DVC md5 `{tags.get('tabrl.snapshot_dvc_md5', 'not versioned')}`, "
            f"sha256 `{tags.get('tabrl.snapshot_sha256', '?')}` "
            f"(`dvc checkout` at the commit whose .dvc file holds that md5 brings it back)."
        )
    elif tags.get("tabrl.kind") == "base":
        lines.append("The base model: no interaction snapshot, not gated.")
    if gate:
        lines += ["", "Gate (candidate vs champion on held-out traffic): passed.", ""]
        columns = ("candidate", "champion", "delta", "tolerance", "margin")
        lines += ["| metric | " + " | ".join(columns) + " |", "| --- " * (len(columns) + 1) + "|"]
        for metric in [key.removeprefix("candidate/") for key in gate if key.startswith("candidate/")]:
            cells = [gate.get(f"{column}/{metric}") for column in columns]
            lines.append(f"| {metric} | " + " | ".join("-" if v is None else f"{v:.4g}" for v in cells) + " |")
    return "\n".join(lines)


def append_version_description(params: Params, version: ModelVersion, text: str) -> None:
    """Add a paragraph (e.g. the A/B decision) to the version's description."""
    client = tracking_client(params)
    current = client.get_model_version(version.name, str(version.version)).description or ""
    client.update_model_version(version.name, str(version.version), description=f"{current}\n\n{text}".strip())


def ensure_champion(base_dir: str | Path, params: Params) -> ModelVersion:
    """The champion; an empty registry first gets the base model as version 1 and alias `champion`.

    A registered model that has versions but no champion is left alone (someone removed the alias, and
    silently serving the base model again would undo their deployment): that is an error to fix by hand.
    """
    found = get_alias_version(params, CHAMPION)
    if found is not None:
        return found
    client = tracking_client(params)
    name = params.deploy.registered_model
    if _ensure_registered_model(client, name) and client.search_model_versions(f"name = '{name}'", max_results=1):
        raise DeployError(
            f"registered model {name!r} has versions but no {CHAMPION!r} alias; set one in the MLflow UI "
            f"or with MlflowClient().set_registered_model_alias({name!r}, {CHAMPION!r}, VERSION)"
        )
    run_id = start_cycle_run(params, run_name="base model", tags={"tabrl.kind": "base"})
    mv = register_candidate(base_dir, params, run_id, tags={"tabrl.kind": "base"})
    client.log_batch(run_id, tags=as_flat_tags({"tabrl.version": mv.label, "tabrl.base_dir": str(base_dir)}))
    client.update_run(run_id, name=f"base model · {mv.label}")
    end_cycle_run(params, run_id)
    set_alias(params, CHAMPION, mv.version)
    return mv


def _ensure_registered_model(client: MlflowClient, name: str) -> bool:
    """Create the registered model when missing; True when it already existed."""
    try:
        client.get_registered_model(name)
        return True
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
    client.create_registered_model(name, description="tabrl code-completion policy (Hugging Face checkpoints)")
    return False


def _version(mv) -> ModelVersion:
    return ModelVersion(name=mv.name, version=int(mv.version), source=mv.source, run_id=mv.run_id or None)


def set_alias(params: Params, alias: str, version: int) -> None:
    """Point `alias` at `version` of the registered model (moves it when it points elsewhere)."""
    tracking_client(params).set_registered_model_alias(params.deploy.registered_model, alias, str(version))


def get_alias_version(params: Params, alias: str) -> ModelVersion | None:
    """The version `alias` points at, or None (no such alias, or no registered model yet)."""
    client = tracking_client(params)
    try:
        model = client.get_registered_model(params.deploy.registered_model)
    except MlflowException as err:
        if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    version = model.aliases.get(alias)
    if version is None:
        return None
    return _version(client.get_model_version(model.name, str(version)))


def delete_alias(params: Params, alias: str) -> bool:
    """Remove `alias`; False when it was not set."""
    if get_alias_version(params, alias) is None:
        return False
    tracking_client(params).delete_registered_model_alias(params.deploy.registered_model, alias)
    return True


# --- local directories ----------------------------------------------------------------------------


def resolve_model_dir(uri: str | Path, params: Params, *, copy: bool = False) -> Path:
    """A local checkpoint directory for `uri`, loadable with `from_pretrained`.

    `uri`: a local directory (returned as is), `models:/NAME@alias`, `models:/NAME/VERSION`, or
    `runs:/RUN_ID/path`. A registry version on a local artifact store resolves to the artifact
    directory itself (read it, never write into it); `copy=True`, or a remote store, downloads into
    `<paths.state_dir>/model_cache` once per version.
    """
    text = str(uri)
    if not text.startswith(("models:/", "runs:/")):
        path = Path(text)
        if not (path / "config.json").is_file():
            raise DeployError(f"model {text!r} is neither a checkpoint directory (no config.json) nor a models:/ URI")
        return path
    cache = Path(params.paths.state_dir) / "model_cache"
    if text.startswith("runs:/"):
        run_id, _, sub = text[len("runs:/") :].partition("/")
        return _download(text, cache / "runs" / run_id / (sub or "root"), params)
    mv = _model_version_of(text, params)
    local = _local_path(mv.source)
    if local is not None and local.is_dir() and not copy:
        return local
    return _download(mv.source, cache / mv.name / str(mv.version), params)


def _model_version_of(uri: str, params: Params) -> ModelVersion:
    body = uri[len("models:/") :]
    client = tracking_client(params)
    try:
        if "@" in body:
            name, alias = body.split("@", 1)
            return _version(client.get_model_version_by_alias(name, alias))
        name, _, version = body.partition("/")
        if not version.isdigit():
            raise DeployError(f"model URI {uri!r} must look like models:/NAME@alias or models:/NAME/VERSION")
        return _version(client.get_model_version(name, version))
    except MlflowException as err:
        raise DeployError(f"cannot resolve {uri!r} in {params.paths.mlflow_tracking_uri}: {err.message}") from err


def _local_path(artifact_uri: str) -> Path | None:
    parsed = urlparse(artifact_uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(artifact_uri)
    return None


def _download(artifact_uri: str, target: Path, params: Params) -> Path:
    if (target / CACHE_DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        got = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=artifact_uri, dst_path=str(staging), tracking_uri=params.paths.mlflow_tracking_uri
            )
        )
        (got / CACHE_DONE).write_text(artifact_uri + "\n")
        if target.exists():  # a partial download from an interrupted earlier call
            shutil.rmtree(target)
        got.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def as_flat_tags(values: Mapping[str, Any]) -> list[RunTag]:
    """MLflow tags from plain values (within the tag value limit)."""
    return [RunTag(_fit(k, MAX_ENTITY_KEY_LENGTH), _fit(str(v), MAX_PARAM_VAL_LENGTH)) for k, v in values.items()]
