"""The root of the params tree: one field per section, and the checks that span sections."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import model_validator

from tasks.core.config.base import Section
from tasks.core.config.data import DataParams, FimParams, ModelParams, SimulatorParams, TeamsParams, TrafficParams
from tasks.core.config.learning import EvaluateParams, RewardParams, TrainParams
from tasks.core.config.operations import ClusterParams, DeployParams, IngestParams, PathsParams, ServingParams


class Params(Section):
    data: DataParams = DataParams()
    """Where the code comes from and how its files are split into train and test (`tabrl corpus`)."""
    fim: FimParams = FimParams()
    """The span FIM samples drawn from the corpus for the judge and the RLinf comparison (`tabrl data`)."""
    model: ModelParams = ModelParams()
    """The base model: where it lives, and the shape and pre-training of tabrl-tiny (`tabrl build-base`)."""
    simulator: SimulatorParams = SimulatorParams()
    """The simulated users: their accept rule, personas and typing (`tabrl simulate`, the demo, evaluation)."""
    traffic: TrafficParams = TrafficParams()
    """The editor-like typing sessions simulated users type (regions of real files, pauses, requests)."""
    reward: RewardParams = RewardParams()
    """What an outcome earns (accepted, rejected, no suggestion), advantages and the typed lines."""
    train: TrainParams = TrainParams()
    """The critic-free PPO update of one cycle: optimiser, clipping, guards, launcher and adapters."""
    evaluate: EvaluateParams = EvaluateParams()
    """The held-out evaluation of a candidate against the champion, the judge and the gate."""
    deploy: DeployParams = DeployParams()
    """The registry, the A/B rollout and decision, and the cycle and decision schedules."""
    serving: ServingParams = ServingParams()
    """The gateway: arms, the show rule, sampling, auth, limits, backends and vLLM servers."""
    ingest: IngestParams = IngestParams()
    """Pulling logged completions since the watermark and cleaning them into a snapshot."""
    cluster: ClusterParams = ClusterParams()
    """Running the flows across machines: Prefect work pools, the training deployment, the DVC remote."""
    paths: PathsParams = PathsParams()
    """Where data, models, local state, the log store and the MLflow tracking store live."""
    teams: TeamsParams = TeamsParams()
    """Teams, each with its own adapter, cycle and gate: their code bases (`tabrl teams`, docs/how-to/teams.md)."""

    @model_validator(mode="after")
    def _adapter_rank(self) -> Params:
        if self.train.adapter == "lora" and self.train.lora_rank > self.serving.vllm_max_lora_rank:
            raise ValueError(
                f"train.lora_rank ({self.train.lora_rank}) exceeds serving.vllm_max_lora_rank "
                f"({self.serving.vllm_max_lora_rank}): vLLM would refuse every adapter; raise the server's limit "
                "or lower the rank"
            )
        return self

    @model_validator(mode="after")
    def _shared_tracking_store(self) -> Params:
        uri = self.paths.mlflow_tracking_uri
        if self.cluster.train_on == "pool" and not uri.startswith(("http://", "https://")):
            raise ValueError(
                f"cluster.train_on = 'pool' needs an MLflow tracking server every host reaches "
                f"(paths.mlflow_tracking_uri = http://HOST:PORT), got paths.mlflow_tracking_uri = {uri!r}"
            )
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, for logging the resolved config (MLflow params)."""
        return dict(_flatten(self.model_dump(mode="json")))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value
