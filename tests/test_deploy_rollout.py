"""Rollout: the challenger goes live at its share, all or nothing (Prefect transaction)."""

import pytest
from prefect import flow

import tasks.deploy.rollout as rollout_mod
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, init_schema, read_arms, replace_arms
from tasks.deploy.errors import DeployError
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import challenger_arms, rollout
from tasks.deploy.tracking import CycleRuns
from tests.conftest import tiny_params


def _live(params, champion_dir):
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm(CHAMPION, "tabrl-completion/1", str(champion_dir), "embedded", 1.0)])
    return engine


@flow
def _rollout_flow(version, model_dir, params):
    return rollout(version, model_dir, params)


def test_rollout_makes_the_challenger_live_at_its_share(tmp_path, mlflow_store, tiny_model_dir, prefect_harness):
    params = tiny_params(tmp_path, deploy={"challenger_share": 0.25})
    registry = Registry(params)
    engine = _live(params, tiny_model_dir)
    registry.ensure_champion(tiny_model_dir)
    version = registry.register(tiny_model_dir, CycleRuns(params).start())
    done = _rollout_flow(version, str(tiny_model_dir), params)
    arms = {a.name: a for a in read_arms(engine)}
    assert arms[CHAMPION].share == pytest.approx(0.75) and arms[CHALLENGER].share == pytest.approx(0.25)
    assert arms[CHALLENGER].model_version == version.label and done.arms == sorted(
        arms.values(), key=lambda a: a.name, reverse=True
    )
    assert registry.aliased(CHALLENGER).version == version.version


def test_a_failing_step_restores_arms_and_aliases(tmp_path, mlflow_store, tiny_model_dir, prefect_harness, monkeypatch):
    params = tiny_params(tmp_path)
    runs = CycleRuns(params)
    registry = Registry(params)
    engine = _live(params, tiny_model_dir)
    registry.ensure_champion(tiny_model_dir)
    first = registry.register(tiny_model_dir, runs.start())
    _rollout_flow(first, str(tiny_model_dir), params)  # an earlier challenger is live
    before = read_arms(engine)
    second = registry.register(tiny_model_dir, runs.start())

    @rollout_mod.task(name="check-arms")
    def failing_check(expected, params, team):
        raise DeployError("injected: the new arms did not come up")

    monkeypatch.setattr(rollout_mod, "check_arms", failing_check)
    with pytest.raises(DeployError, match="injected"):
        _rollout_flow(second, str(tiny_model_dir), params)
    assert read_arms(engine) == before  # the arms swap was undone
    assert registry.aliased(CHALLENGER).version == first.version  # and the alias put back


def test_rollout_needs_a_live_champion(tmp_path):
    params = tiny_params(tmp_path)
    with pytest.raises(DeployError, match="no live 'champion' arm"):
        challenger_arms([], None, "/m", params)
