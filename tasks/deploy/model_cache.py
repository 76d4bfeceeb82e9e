"""Local directories of models: the candidates trained here and the cache of downloaded versions and run artifacts.

Resolving ``models:/NAME@alias`` on a local artifact store (a SQLite or file tracking URI, artifacts under
``paths.state_dir``) returns the artifact directory itself, no copy; on a remote store (an ``mlflow server``,
S3, ...) it downloads once into ``<state_dir>/model_cache/NAME/VERSION`` and reuses that (versions are
immutable, so the cache never goes stale). ``runs:/`` artifacts go to ``<state_dir>/model_cache/runs/RUN_ID``.
A download is staged in a hidden directory and marked complete last, so an interrupted one is never read.
Downloads and the candidates trained here (``<models_dir>/candidates/RUN_ID``) that no arm serves and no alias
names are deleted after ``deploy.retired_retention_hours`` (``model_retention.py``); the registry's copy stays.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import mlflow

from tasks.core.adapters import is_adapter
from tasks.core.config import Params
from tasks.deploy.errors import DeployError
from tasks.deploy.tracking import tracking_client
from tasks.deploy.versions import ModelVersion, version_named

CACHE_DONE = ".tabrl-complete"  # written last into a downloaded model dir; a dir without it is partial
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
    return version_dir(version_named(tracking_client(params), text), params, copy=copy)


def version_dir(version: ModelVersion, params: Params, *, copy: bool = False) -> Path:
    """A local directory of `version`: its artifact directory on a local store (unless `copy`), else its download."""
    local = local_path(version.source)
    if local is not None and local.is_dir() and not copy:
        return local
    return _download(version.source, version_cache_dir(version, params), params)


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
