"""The reward stage as a Prefect task (the work is in ``reward.reward_snapshot``)."""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.core.config import RewardParams
from tasks.reward.reward import RewardResult, reward_metrics, reward_snapshot
from tasks.sim.users import Summary


@task(name="reward", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def reward_task(
    snapshot: Path, params: RewardParams, out: Path, arms: dict[str, Summary] | None = None
) -> RewardResult:
    """Rewards and advantages for one snapshot; log the per-arm summary to MLflow if a run is active."""
    result = reward_snapshot(Path(snapshot), params, Path(out), arms)
    if mlflow.active_run():
        mlflow.log_metrics(reward_metrics(result))
    return result
