"""A registered model version as tabrl sees it, and the `models:/` URIs that name one.

Below both the registry (``registry.py``, which reads and writes versions) and the model cache
(``model_cache.py``, which puts them on disk): the registry's adapter check needs a version's files, and the
cache needs to know which version a `models:/` URI names.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion as MlflowModelVersion
from mlflow.exceptions import MlflowException

from tasks.core import vocab
from tasks.deploy.errors import DeployError


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

    @classmethod
    def of(cls, mv: MlflowModelVersion) -> ModelVersion:
        """The version MLflow's client returned."""
        return cls(
            name=mv.name,
            version=int(mv.version),
            source=mv.source,
            run_id=mv.run_id or None,
            base=(mv.tags or {}).get(vocab.BASE_VERSION),
        )


def version_named(client: MlflowClient, uri: str) -> ModelVersion:
    """The version `models:/NAME@alias` or `models:/NAME/VERSION` names; a DeployError naming the store when none."""
    body = uri[len("models:/") :]
    try:
        if "@" in body:
            name, alias = body.split("@", 1)
            return ModelVersion.of(client.get_model_version_by_alias(name, alias))
        name, _, version = body.partition("/")
        if not version.isdigit():
            raise DeployError(f"model URI {uri!r} must look like models:/NAME@alias or models:/NAME/VERSION")
        return ModelVersion.of(client.get_model_version(name, version))
    except MlflowException as err:
        raise DeployError(f"cannot resolve {uri!r} in {client.tracking_uri}: {err.message}") from err
