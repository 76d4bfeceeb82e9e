"""Model retention: delete this host's copies of retired model versions once they are old enough.

    tabrl model-retention [--dry-run]      # by hand; every online cycle runs it right after resolving its champion

Not the log retention (``serving/retention.py``, ``tabrl purge``), which deletes old completion and feedback
rows from the log store: this deletes checkpoint directories on disk. Only the direct entries of two folders
are ever deleted:

* ``<paths.models_dir>/candidates/<cycle run id>``: candidates trained on this host (``flows/remote_training.py``);
* ``<paths.state_dir>/model_cache/<NAME>/<VERSION>`` and ``.../model_cache/runs/<RUN_ID>``: registry versions and
  run artifacts downloaded from the tracking server (``tasks/deploy/model_cache.py``).

A copy is live, and kept, while an arm of the log store serves it (the arm's ``model_uri`` or ``adapter`` lies
in it), while an alias (``champion``, ``challenger``) names its version or an adapter version that runs on it,
while it holds the recorded base of a live adapter, or while its cycle run is still running (a candidate being
trained or evaluated). Any other copy is retired, and is deleted once its newest file is
``deploy.retired_retention_hours`` old (0: at once). The registry keeps every version's artifact, so a deleted
version is downloaded again when it is needed. Never deleted, whatever the folders hold: anything inside an
MLflow artifact location (on a local store that is the registry's one copy), the base model
(``model.base_dir``), hidden entries (a download still being staged: ``.download-*``) and symbolic links.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import ViewType
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from sqlalchemy.engine import Engine

from tasks.core.adapters import AdapterBaseError, is_adapter, read_base
from tasks.core.config import Params
from tasks.core.store import CHALLENGER, CHAMPION, known_teams, open_store, read_arms
from tasks.deploy.model_cache import CANDIDATES, RUN_CACHE, local_path, model_cache_dir, version_dirs
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import tracking_client

log = logging.getLogger("tabrl.model_retention")

SECONDS_PER_HOUR = 3600.0
RUNNING = "RUNNING"  # MLflow's status of a run that has not ended


@dataclass(frozen=True)
class LocalCopy:
    """One directory that holds a local copy of a model, and what retention does with it."""

    path: Path
    what: str  # e.g. "candidate of cycle run 3f2c...", "download of tabrl-completion/3"
    age_hours: float  # since its newest file (or directory) was last written
    size_bytes: int  # its files' sizes, summed
    retired: bool  # True: deleted (or, in a dry run, would be)
    why: str  # why it is retired, or why it is kept


@dataclass(frozen=True)
class FoundCopy:
    """A directory retention looks at, before its verdict."""

    path: Path
    what: str
    run_id: str | None  # the cycle run that wrote it (candidates, run downloads): kept while that run runs


def local_copies(params: Params) -> list[FoundCopy]:
    """The directories retention looks at: candidates, and the model cache's versions and run downloads."""
    candidates = Path(params.paths.models_dir) / CANDIDATES
    cache = model_cache_dir(params)
    found = [FoundCopy(d, f"candidate of cycle run {d.name}", d.name) for d in _entries(candidates)]
    for model in _entries(cache):
        if model.name == RUN_CACHE:
            found += [FoundCopy(d, f"download of run {d.name}'s artifacts", d.name) for d in _entries(model)]
        else:
            found += [FoundCopy(d, f"download of {model.name}/{d.name}", None) for d in _entries(model)]
    return found


def _entries(folder: Path) -> list[Path]:
    """The directories directly in folder, hidden ones and symbolic links left out; none when it is missing."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def live_dirs(engine: Engine, params: Params) -> dict[Path, str]:
    """Resolved directory -> why it is live: every team's arms' checkpoints and adapters, the versions its aliases
    name and their base versions' (an adapter version's), and the recorded base of each live adapter."""
    live: dict[Path, str] = {}
    for arm in read_arms(engine, None):
        if "://" not in arm.model_uri:  # a vLLM arm's model_uri is its server's URL
            live[Path(arm.model_uri).resolve()] = f"arm {arm.name!r} serves it ({arm.model_version})"
        if arm.adapter:
            live[Path(arm.adapter).resolve()] = f"arm {arm.name!r} serves it as its adapter ({arm.model_version})"
    for team in known_teams(engine):
        registry = Registry(params, team)
        for alias in (CHAMPION, CHALLENGER):
            version = registry.aliased(alias)
            if version is None:
                continue
            for d in version_dirs(version, params):
                live[d.resolve()] = f"alias {alias!r} names {version.label}"
            base = registry.base_of(version)  # an adapter version runs on a full version of its own
            for d in version_dirs(base, params):
                live.setdefault(d.resolve(), f"the base of {version.label}, which alias {alias!r} names")
    for d, why in list(live.items()):
        if is_adapter(d):
            try:
                live.setdefault(Path(read_base(d).path).resolve(), f"the base of a live adapter ({why})")
            except AdapterBaseError:  # no base record: nothing to keep for it
                pass
    return live


def protected_dirs(params: Params, client: MlflowClient) -> dict[Path, str]:
    """Resolved directory -> why nothing in it (or holding it) is ever deleted: the base model and every local
    MLflow artifact location (on a local store the registry's one copy of each version)."""
    protected = {Path(params.model.base_dir).resolve(): "model.base_dir (the base model)"}
    for experiment in client.search_experiments(view_type=ViewType.ALL):
        location = local_path(experiment.artifact_location)
        if location is not None:
            protected[location.resolve()] = f"MLflow artifact location of experiment {experiment.name!r}"
    return protected


def plan_model_retention(engine: Engine, params: Params, now: float | None = None) -> list[LocalCopy]:
    """Every local copy with its age, size and verdict: retired (live nowhere, and at least
    `deploy.retired_retention_hours` old) or kept, and why. Reads the arms, the registry and the files; changes
    nothing (`delete_retired` does)."""
    now = time.time() if now is None else now
    retention_h = params.deploy.retired_retention_hours
    client = tracking_client(params)
    live = live_dirs(engine, params)
    protected = protected_dirs(params, client)
    plan = []
    for found in local_copies(params):
        path = found.path.resolve()
        newest, size = _newest_mtime_and_bytes(found.path)
        age_h = max(now - newest, 0.0) / SECONDS_PER_HOUR
        keep = _overlapping(path, protected) or _overlapping(path, live)
        if keep is None and found.run_id is not None and _running(client, found.run_id):
            keep = f"cycle run {found.run_id} is still running"
        if keep is None and age_h < retention_h:
            keep = f"written {age_h:.1f} h ago, under deploy.retired_retention_hours={retention_h:g}"
        why = keep or f"no arm serves it and no alias names it; written {age_h:.1f} h ago"
        plan.append(LocalCopy(found.path, found.what, age_h, size, retired=keep is None, why=why))
    return plan


def delete_retired(plan: list[LocalCopy]) -> list[LocalCopy]:
    """Delete the retired copies of a plan (`plan_model_retention`), logging each; returns those deleted."""
    deleted = []
    for copy in plan:
        if copy.retired:
            shutil.rmtree(copy.path)
            log.info(
                "deleted %s (%s, %.1f MB, %.1f h old): %s",
                copy.path,
                copy.what,
                copy.size_bytes / 1e6,
                copy.age_hours,
                copy.why,
            )
            deleted.append(copy)
    return deleted


@task(name="model-retention", retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE)
def model_retention_task(params: Params) -> list[LocalCopy]:
    """Delete the local copies of retired versions past `deploy.retired_retention_hours`; returns those deleted."""
    with open_store(params.paths.database_url) as engine:
        plan = plan_model_retention(engine, params)
    deleted = delete_retired(plan)
    freed_mb = sum(c.size_bytes for c in deleted) / 1e6
    kept = len(plan) - len(deleted)
    get_run_logger().info(f"model retention: deleted {len(deleted)} retired copies ({freed_mb:.1f} MB); kept {kept}")
    return deleted


def _overlapping(path: Path, dirs: dict[Path, str]) -> str | None:
    """Why path must stay when it is one of dirs, holds one, or lies inside one; else None."""
    for d, why in dirs.items():
        if d == path or d.is_relative_to(path) or path.is_relative_to(d):
            return why
    return None


def _running(client: MlflowClient, run_id: str) -> bool:
    """Is MLflow run run_id still running? A name that is no run of this store is not."""
    try:
        return client.get_run(run_id).info.status == RUNNING
    except MlflowException as err:
        if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return False
        raise


def _newest_mtime_and_bytes(folder: Path) -> tuple[float, int]:
    """The newest modification time of folder and everything in it, and its files' total size (links not
    followed)."""
    newest, size = folder.lstat().st_mtime, 0
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
        for name in files:
            stat = os.lstat(os.path.join(root, name))
            newest, size = max(newest, stat.st_mtime), size + stat.st_size
    return newest, size
