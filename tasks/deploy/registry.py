"""The MLflow model registry side of deploy: one registered model, its versions, aliases, local model dirs.

* A candidate checkpoint (a Hugging Face directory, or a LoRA adapter on a registered base version:
  ``tasks/core/adapters.py``) becomes a new version of ``deploy.registered_model``. An adapter version is
  tagged with its base (``tabrl.base_version``, ``tabrl.base_sha256``), and one whose recorded base
  is not that version's weights is refused.
  MLflow 3.17's ``register_model('runs:/..')`` refuses plain folders (it wants an MLmodel file), so the
  folder is logged once as its cycle run's ``model`` artifact and the version is created by reference
  to it with ``MlflowClient.create_model_version(source=<run artifact uri>/model)``. The version's
  description links its run, its snapshot and the gate's numbers; the A/B decision adds its own.
* Aliases ``champion`` (serves 100 % unless a test runs) and ``challenger`` (under A/B test).

The cycle runs themselves (experiments, params, names, tags) are in ``tracking.py``.

Copies of big checkpoints: the registry holds exactly one immutable copy, the run artifact (the
trainer's output directory is scratch that the next cycle may overwrite, so a reference to it would
not be reproducible). Registering a version adds no copy (the version points at the artifact).
Resolving ``models:/NAME@alias`` on a local artifact store (a SQLite or file tracking URI, artifacts
under ``paths.state_dir``) returns the artifact directory itself, no copy; on a remote store (an
``mlflow server``, S3, ...) it downloads once into ``<state_dir>/model_cache/NAME/VERSION`` and
reuses that (versions are immutable, so the cache never goes stale). Downloads and the candidates trained
here (``<models_dir>/candidates/RUN_ID``) that no arm serves and no alias names are deleted after
``deploy.retired_retention_hours`` (``model_retention.py``); the registry's copy stays.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from tasks.core.adapters import AdapterBaseError, check_base, is_adapter
from tasks.core.config import Params
from tasks.core.store import CHAMPION
from tasks.deploy.errors import DeployError
from tasks.deploy.tracking import as_flat_tags, end_cycle_run, get_run, start_cycle_run, tracking_client

MODEL_ARTIFACT = "model"
SNAPSHOT_TAGS = ("tabrl.snapshot", "tabrl.snapshot_sha256", "tabrl.snapshot_dvc_md5")  # copied onto its version
CACHE_DONE = ".tabrl-complete"  # written last into a downloaded model dir; a dir without it is partial


WEIGHTS_TAG = "tabrl.weights"  # "full" | "lora"
BASE_VERSION_TAG = "tabrl.base_version"  # an adapter's base: NAME/VERSION of a full version
BASE_SHA_TAG = "tabrl.base_sha256"


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: int
    source: str  # artifact URI of the checkpoint (or adapter) directory
    run_id: str | None  # the cycle run that produced it
    base: str | None = None  # an adapter's base version, NAME/VERSION (None: a full checkpoint)

    @property
    def uri(self) -> str:
        """`models:/NAME/VERSION`, immutable (an alias URI moves)."""
        return f"models:/{self.name}/{self.version}"

    @property
    def label(self) -> str:
        """`NAME/VERSION`: what arms and completions record as their model version."""
        return f"{self.name}/{self.version}"


# --- registered model versions and aliases ---------------------------------------------------------


def register_candidate(
    model_dir: str | Path,
    params: Params,
    run_id: str,
    tags: Mapping[str, str] | None = None,
    *,
    gate: Mapping[str, float] | None = None,
    base: ModelVersion | None = None,
) -> ModelVersion:
    """Log a checkpoint (or adapter) directory as the run's `model` artifact and register it as a new version.

    The one copy the registry keeps is this artifact; the version refers to it. Its description
    links the run, names the snapshot it was trained on and, given `gate` (the numbers of the gate it
    passed, `GateDecision.numbers`), shows what the gate compared. An adapter needs `base`, the full version
    it was trained on (checked against the adapter's record of its base's weights), and is tagged with it.
    """
    model_dir = Path(model_dir)
    adapter_tags = _base_tags(model_dir, base, params) if is_adapter(model_dir) else {WEIGHTS_TAG: "full"}
    if not is_adapter(model_dir) and not (model_dir / "config.json").is_file():
        raise DeployError(f"{model_dir} is neither a Hugging Face checkpoint directory (no config.json) nor an adapter")
    client = tracking_client(params)
    run = get_run(client, run_id)
    client.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACT)
    name = params.deploy.registered_model
    _ensure_registered_model(client, name)
    version_tags = {"tabrl.cycle_run_id": run_id, **adapter_tags, **(tags or {})}
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


CHARS_HOLDER_TAG = "tabrl.chars_saved_holder"
"""Version tag: the version of its lineage that saved the most characters in the gates along it, when that
is an ancestor (absent: the version itself). Each gate types that version through its own requests too,
for the lineage's characters-saved mark: a score carried over as a number, measured on other requests or
chosen on these, would be no mark."""


def chars_saved_holder(version: ModelVersion, params: Params) -> ModelVersion | None:
    """The ancestor holding `version`'s lineage mark for characters saved (`CHARS_HOLDER_TAG`); None when the
    version holds it itself (the base, a version registered by hand, one that set the mark)."""
    client = tracking_client(params)
    raw = client.get_model_version(version.name, str(version.version)).tags.get(CHARS_HOLDER_TAG)
    if raw is None or int(raw) == version.version:
        return None
    return _version(client.get_model_version(version.name, raw))


def _version(mv) -> ModelVersion:
    return ModelVersion(
        name=mv.name,
        version=int(mv.version),
        source=mv.source,
        run_id=mv.run_id or None,
        base=(mv.tags or {}).get(BASE_VERSION_TAG),
    )


def _base_tags(adapter_dir: Path, base: ModelVersion | None, params: Params) -> dict[str, str]:
    """The tags of an adapter version: its base version, once the adapter is shown to be trained on its weights."""
    if base is None:
        raise DeployError(f"{adapter_dir} is a LoRA adapter: registering it needs the full version it was trained on")
    if base.base is not None:
        raise DeployError(f"{base.label} is itself an adapter; an adapter's base is a full checkpoint version")
    try:
        record = check_base(adapter_dir, resolve_model_dir(base.uri, params), "register")
    except AdapterBaseError as err:
        raise DeployError(f"refused to register {adapter_dir} on {base.label}: {err}") from err
    return {WEIGHTS_TAG: "lora", BASE_VERSION_TAG: base.label, BASE_SHA_TAG: record.sha256}


def base_version(version: ModelVersion, params: Params) -> ModelVersion:
    """The full version a version runs on: its base (an adapter), or itself."""
    if version.base is None:
        return version
    name, _, number = version.base.rpartition("/")
    return _version(tracking_client(params).get_model_version(name, number))


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

CANDIDATES = "candidates"  # under paths.models_dir: one checkpoint per cycle run that trained on this host
MODEL_CACHE = "model_cache"  # under paths.state_dir: downloaded versions (NAME/VERSION) and run artifacts
RUN_CACHE = "runs"  # under the model cache: artifacts downloaded by `runs:/` URI, one directory per run


def candidate_dir(params: Params, run_id: str) -> Path:
    """Where cycle run `run_id` trains its candidate on this host: `<paths.models_dir>/candidates/<run_id>`."""
    return Path(params.paths.models_dir) / CANDIDATES / run_id


def model_cache_dir(params: Params) -> Path:
    """The model cache: `<paths.state_dir>/model_cache`."""
    return Path(params.paths.state_dir) / MODEL_CACHE


def version_cache_dir(version: ModelVersion, params: Params) -> Path:
    """Where `version` is downloaded to: `<paths.state_dir>/model_cache/<NAME>/<VERSION>`."""
    return model_cache_dir(params) / version.name / str(version.version)


def version_dirs(version: ModelVersion, params: Params) -> list[Path]:
    """Where `resolve_model_dir` finds `version` or would put it, without downloading anything: its artifact
    directory when the store is local, and its directory in the model cache."""
    local = local_path(version.source)
    return [local, version_cache_dir(version, params)] if local is not None else [version_cache_dir(version, params)]


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
        if not (path / "config.json").is_file() and not is_adapter(path):
            raise DeployError(
                f"model {text!r} is neither a checkpoint directory (no config.json), an adapter, nor a models:/ URI"
            )
        return path
    if text.startswith("runs:/"):
        run_id, _, sub = text[len("runs:/") :].partition("/")
        return _download(text, model_cache_dir(params) / RUN_CACHE / run_id / (sub or "root"), params)
    mv = model_version_of(text, params)
    local = local_path(mv.source)
    if local is not None and local.is_dir() and not copy:
        return local
    return _download(mv.source, version_cache_dir(mv, params), params)


def model_version_of(uri: str, params: Params) -> ModelVersion:
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


def local_path(artifact_uri: str) -> Path | None:
    """The local path of a `file:` or scheme-less artifact URI; None for a remote one (http, s3, mlflow-artifacts)."""
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
