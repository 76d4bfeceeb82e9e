"""The MLflow model registry side of deploy: one registered model, its versions and its aliases.

* A candidate checkpoint (a Hugging Face directory, or a LoRA adapter on a registered base version:
  ``tasks/core/adapters.py``) becomes a new version of ``deploy.registered_model``. An adapter version is
  tagged with its base (``tabrl.base_version``, ``tabrl.base_sha256``), and one whose recorded base
  is not that version's weights is refused.
  MLflow 3.17's ``register_model('runs:/..')`` refuses plain folders (it wants an MLmodel file), so the
  folder is logged once as its cycle run's ``model`` artifact and the version is created by reference
  to it with ``MlflowClient.create_model_version(source=<run artifact uri>/model)``. An ``MLmodel`` file beside
  the checkpoint makes it an MLflow pyfunc model too (``mlflow.pyfunc.load_model``: ``mlflow_model.py``). The version's
  description links its run, its snapshot and the gate's numbers; the A/B decision adds its own.
* Aliases ``champion`` (serves 100 % unless a test runs) and ``challenger`` (under A/B test).
* Each team is one registered model of its own, ``deploy.registered_model``.TEAM (tag ``tabrl.team``), with its
  own two aliases; its versions are adapters on a full version of the organisation's model. A team without a
  champion of its own trains from, and is gated against, the organisation's champion (``Registry.lineage``).

All of it goes through one object, :class:`Registry`, which holds one MLflow client. The cycle runs themselves
(experiments, params, names, tags) are in ``tracking.py``; a version as a value, in ``versions.py``.

Copies of big checkpoints: the registry holds exactly one immutable copy, the run artifact (the
trainer's output directory is scratch that the next cycle may overwrite, so a reference to it would
not be reproducible). Registering a version adds no copy (the version points at the artifact). Where a
version is found or downloaded on this host is ``model_cache.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from tasks.core import vocab
from tasks.core.adapters import AdapterBaseError, check_base, is_adapter
from tasks.core.config import Params
from tasks.core.store import CHAMPION
from tasks.core.teams import ORG, scoped
from tasks.deploy.errors import DeployError
from tasks.deploy.mlflow_model import log_mlmodel
from tasks.deploy.model_cache import resolve_model_dir, version_dir
from tasks.deploy.tracking import CycleRuns, get_run, tracking_client
from tasks.deploy.versions import ModelVersion, version_named

MODEL_ARTIFACT = "model"


@dataclass(frozen=True)
class Lineage:
    """The champion a cycle trains from and the full version it runs on (an adapter's base, else the champion
    itself), each with its local directory."""

    champion: ModelVersion
    champion_dir: Path
    base: ModelVersion
    base_dir: Path

    @property
    def adapter_base(self) -> ModelVersion | None:
        """The base of an adapter champion; None when the champion is a full checkpoint."""
        return self.base if self.base != self.champion else None


class Registry:
    """The registered model `deploy.registered_model` (a team's: `deploy.registered_model`.TEAM): its versions, their
    descriptions and tags, and the aliases `champion` and `challenger`; through one MLflow client on
    `paths.mlflow_tracking_uri`."""

    def __init__(self, params: Params, team: str = ORG) -> None:
        self.params = params
        self.team = team
        self.name = scoped(params.deploy.registered_model, team)
        self.client = tracking_client(params)

    # --- versions ----------------------------------------------------------------------------------

    def register(
        self,
        model_dir: str | Path,
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
        adapter_tags = self._base_tags(model_dir, base) if is_adapter(model_dir) else {vocab.WEIGHTS: "full"}
        if not is_adapter(model_dir) and not (model_dir / "config.json").is_file():
            raise DeployError(
                f"{model_dir} is neither a Hugging Face checkpoint directory (no config.json) nor an adapter"
            )
        run = get_run(self.client, run_id)
        self.client.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACT)
        log_mlmodel(self.client, run_id, MODEL_ARTIFACT)  # the folder is an MLflow pyfunc model too (mlflow_model.py)
        self._ensure_registered_model()
        version_tags = {vocab.CYCLE_RUN_ID: run_id, **adapter_tags, **(tags or {})}
        for key in vocab.SNAPSHOT_TAGS:
            if run.data.tags.get(key):
                version_tags[key] = run.data.tags[key]
        mv = self.client.create_model_version(
            self.name,
            source=f"{run.info.artifact_uri}/{MODEL_ARTIFACT}",
            run_id=run_id,
            tags=version_tags,
            description=version_description(run, gate),
        )
        return ModelVersion.of(mv)

    def _base_tags(self, adapter_dir: Path, base: ModelVersion | None) -> dict[str, str]:
        """The tags of an adapter version: its base version, once the adapter is shown to be trained on its weights."""
        if base is None:
            raise DeployError(
                f"{adapter_dir} is a LoRA adapter: registering it needs the full version it was trained on"
            )
        if base.base is not None:
            raise DeployError(f"{base.label} is itself an adapter; an adapter's base is a full checkpoint version")
        try:
            record = check_base(adapter_dir, version_dir(self.version_of(base.uri), self.params), "register")
        except AdapterBaseError as err:
            raise DeployError(f"refused to register {adapter_dir} on {base.label}: {err}") from err
        return {vocab.WEIGHTS: "lora", vocab.BASE_VERSION: base.label, vocab.BASE_SHA256: record.sha256}

    def _ensure_registered_model(self) -> bool:
        """Create the registered model when missing; True when it already existed."""
        try:
            self.client.get_registered_model(self.name)
            return True
        except MlflowException as err:
            if err.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
        self.client.create_registered_model(
            self.name,
            tags={vocab.TEAM: self.team},
            description="tabrl code-completion policy (Hugging Face checkpoints)"
            + ("" if self.team == ORG else f": team {self.team}'s adapters on the organisation's base"),
        )
        return False

    def append_description(self, version: ModelVersion, text: str) -> None:
        """Add a paragraph (e.g. the A/B decision) to the version's description."""
        current = self.client.get_model_version(version.name, str(version.version)).description or ""
        self.client.update_model_version(version.name, str(version.version), description=f"{current}\n\n{text}".strip())

    def version_of(self, uri: str) -> ModelVersion:
        """The version `models:/NAME@alias` or `models:/NAME/VERSION` names (a DeployError when none)."""
        return version_named(self.client, uri)

    def base_of(self, version: ModelVersion) -> ModelVersion:
        """The full version a version runs on: its base (an adapter), or itself."""
        if version.base is None:
            return version
        name, _, number = version.base.rpartition("/")
        return ModelVersion.of(self.client.get_model_version(name, number))

    def lineage(self) -> Lineage:
        """The champion (registered from model.base_dir when there is none) and the full version it runs on. A team
        without a champion of its own has the organisation's: its first adapter continues from it."""
        if self.team != ORG and self.aliased(CHAMPION) is None:
            return Registry(self.params).lineage()
        champion = self.ensure_champion(self.params.model.base_dir)
        base = self.base_of(champion)
        return Lineage(
            champion, resolve_model_dir(champion.uri, self.params), base, resolve_model_dir(base.uri, self.params)
        )

    def chars_saved_holder(self, version: ModelVersion) -> ModelVersion | None:
        """The ancestor holding `version`'s lineage mark for characters saved (`vocab.CHARS_SAVED_HOLDER`); None when
        the version holds it itself (the base, a version registered by hand, one that set the mark). Each gate types
        that version through its own requests too, for the lineage's mark: a score carried over as a number,
        measured on other requests or chosen on these, would be no mark."""
        raw = self.client.get_model_version(version.name, str(version.version)).tags.get(vocab.CHARS_SAVED_HOLDER)
        if raw is None or int(raw) == version.version:
            return None
        return ModelVersion.of(self.client.get_model_version(version.name, raw))

    # --- aliases -----------------------------------------------------------------------------------

    def ensure_champion(self, base_dir: str | Path) -> ModelVersion:
        """The champion; an empty registry first gets the base model as version 1 and alias `champion`.

        A registered model that has versions but no champion is left alone (someone removed the alias, and
        silently serving the base model again would undo their deployment): that is an error to fix by hand. A
        team's model gets its champion by promotion only (its base is the organisation's).
        """
        found = self.aliased(CHAMPION)
        if found is not None:
            return found
        if self.team != ORG:
            raise DeployError(
                f"team {self.team}'s model {self.name!r} has no champion yet: its callers get the organisation's"
            )
        existed = self._ensure_registered_model()
        if existed and self.client.search_model_versions(f"name = '{self.name}'", max_results=1):
            raise DeployError(
                f"registered model {self.name!r} has versions but no {CHAMPION!r} alias; set one in the MLflow UI "
                f"or with MlflowClient().set_registered_model_alias({self.name!r}, {CHAMPION!r}, VERSION)"
            )
        runs = CycleRuns(self.params)
        run_id = runs.start(run_name="base model", tags={vocab.KIND: "base"})
        mv = self.register(base_dir, run_id, tags={vocab.KIND: "base"})
        runs.tag(run_id, {vocab.VERSION: mv.label, vocab.BASE_DIR: str(base_dir)})
        runs.rename(run_id, f"base model · {mv.label}")
        runs.end(run_id)
        self.set_alias(CHAMPION, mv.version)
        return mv

    def aliased(self, alias: str) -> ModelVersion | None:
        """The version `alias` points at, or None (no such alias, or no registered model yet)."""
        try:
            model = self.client.get_registered_model(self.name)
        except MlflowException as err:
            if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                return None
            raise
        version = model.aliases.get(alias)
        if version is None:
            return None
        return ModelVersion.of(self.client.get_model_version(model.name, str(version)))

    def set_alias(self, alias: str, version: int) -> None:
        """Point `alias` at `version` of the registered model (moves it when it points elsewhere)."""
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def delete_alias(self, alias: str) -> bool:
        """Remove `alias`; False when it was not set."""
        if self.aliased(alias) is None:
            return False
        self.client.delete_registered_model_alias(self.name, alias)
        return True


def version_description(run: Run, gate: Mapping[str, float] | None) -> str:
    """Markdown for a version's page in the MLflow UI: its run (a link), its snapshot, the gate's numbers."""
    tags = run.data.tags
    link = f"[{run.info.run_name or run.info.run_id}](#/experiments/{run.info.experiment_id}/runs/{run.info.run_id})"
    lines = [f"Trained in run {link} (run id `{run.info.run_id}`)."]
    if tags.get(vocab.SNAPSHOT):
        lines.append(
            f"Snapshot `{tags[vocab.SNAPSHOT]}`: DVC md5 `{tags.get(vocab.SNAPSHOT_DVC_MD5, 'not versioned')}`, "
            f"sha256 `{tags.get(vocab.SNAPSHOT_SHA256, '?')}` "
            f"(`dvc checkout` at the commit whose .dvc file holds that md5 brings it back)."
        )
    elif tags.get(vocab.KIND) == "base":
        lines.append("The base model: no interaction snapshot, not gated.")
    if gate:
        lines += ["", "Gate (candidate vs champion on held-out traffic): passed.", ""]
        columns = ("candidate", "champion", "delta", "tolerance", "margin")
        lines += ["| metric | " + " | ".join(columns) + " |", "| --- " * (len(columns) + 1) + "|"]
        for metric in [key.removeprefix("candidate/") for key in gate if key.startswith("candidate/")]:
            cells = [gate.get(f"{column}/{metric}") for column in columns]
            lines.append(f"| {metric} | " + " | ".join("-" if v is None else f"{v:.4g}" for v in cells) + " |")
    return "\n".join(lines)
