"""Adapter versions through the registry, the rollout and the gateway (embedded arms: one base, PEFT adapters).

The real vLLM server path (one server, runtime load/unload, a restart) is tests/test_serving_vllm_lora.py."""

from __future__ import annotations

import httpx
import pytest
import sqlalchemy as sa
from prefect import flow

from serving.gateway import create_app
from tasks.core import vocab
from tasks.core.adapters import checkpoint_sha256
from tasks.core.fim import QWEN
from tasks.core.generate import generate, load_model
from tasks.core.store import CHALLENGER, CHAMPION, Arm, completions, open_store, read_arms, replace_arms
from tasks.deploy.errors import DeployError
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.promote import promote, rollback
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.deploy.tracking import CycleRuns, tracking_client
from tests.conftest import tiny_params
from tests.serving_util import serve_app

PROMPTS = [QWEN.render("def add(a, b):\n    return ", "\n"), QWEN.render("import os\n\npath = os.path.", "\n")]


@flow
def _rollout_flow(version, model_dir, params, base_dir):
    return rollout(version, model_dir, params, base_dir)


def test_an_adapter_version_is_tagged_with_its_base_and_refused_on_another(
    tmp_path, mlflow_store, tiny_model_dir, babbler_dir, tiny_adapter_dir
):
    params = tiny_params(tmp_path)
    runs = CycleRuns(params)
    registry = Registry(params)
    base = registry.ensure_champion(tiny_model_dir)
    version = registry.register(tiny_adapter_dir, runs.start(), base=base)
    tags = tracking_client(params).get_model_version(version.name, str(version.version)).tags
    assert (tags[vocab.BASE_VERSION], tags[vocab.BASE_SHA256]) == (base.label, checkpoint_sha256(tiny_model_dir))
    assert version.base == base.label and registry.base_of(version) == base
    assert {p.name for p in resolve_model_dir(version.uri, params).iterdir()} >= {"adapter_model.safetensors"}
    other = registry.register(babbler_dir, runs.start())  # a full version with other weights
    with pytest.raises(DeployError, match="trained on another base"):
        registry.register(tiny_adapter_dir, runs.start(), base=other)
    with pytest.raises(DeployError, match="needs the full version it was trained on"):
        registry.register(tiny_adapter_dir, runs.start())


def test_both_arms_on_one_base_serve_their_own_weights_then_promote_and_rollback(
    tmp_path, mlflow_store, prefect_harness, tiny_model_dir, tiny_adapter_dir
):
    params = tiny_params(tmp_path, serving={"auth": False, "config_ttl_s": 0, "max_tokens": 8, "temperature": 0})
    runs = CycleRuns(params)
    registry = Registry(params)
    base = registry.ensure_champion(tiny_model_dir)
    with open_store(params.paths.database_url) as engine:
        replace_arms(engine, [Arm(CHAMPION, base.label, str(tiny_model_dir), "embedded", 1.0)])
    version = registry.register(tiny_adapter_dir, runs.start(), base=base)
    done = _rollout_flow(version, str(resolve_model_dir(version.uri, params)), params, str(tiny_model_dir))
    challenger = next(a for a in done.arms if a.name == CHALLENGER)
    assert challenger.model_uri == str(tiny_model_dir)  # on the champion's base, not a copy of it
    assert challenger.adapter and challenger.served_model and challenger.served_model.startswith("tabrl-completion-v")

    with open_store(params.paths.database_url) as engine, serve_app(create_app(params, engine=engine)) as url:
        answers = {
            arm: [
                httpx.post(
                    f"{url}/v1/completions",
                    json={"prompt": p, "user": "u", "max_tokens": 8},
                    headers={"X-Tabrl-Arm": arm},
                    timeout=60,
                )
                for p in PROMPTS
            ]
            for arm in (CHAMPION, CHALLENGER)
        }
        with engine.connect() as conn:
            logged = {r.id: r for r in conn.execute(sa.select(completions))}
    served = {arm: [logged[a.json()["id"]] for a in got] for arm, got in answers.items()}
    for arm, model_dir in ((CHAMPION, tiny_model_dir), (CHALLENGER, tiny_adapter_dir)):
        # the base with adapters disabled, and base + this adapter (as merged): the same tokens and log-probs
        for row, local in zip(served[arm], generate(*load_model(model_dir), PROMPTS, 8), strict=True):
            assert row.token_ids == local.token_ids
            assert row.logprobs == pytest.approx(local.logprobs, abs=1e-4)
            assert row.model_version == (base.label if arm == CHAMPION else version.label)
    apart = [(a.token_ids, a.logprobs) != (b.token_ids, b.logprobs) for a, b in zip(*served.values(), strict=True)]
    assert all(apart)  # two models, not one

    with open_store(params.paths.database_url) as engine:
        change = promote(engine, params)
        assert [a.adapter for a in change.arms] == [challenger.adapter]  # the adapter is the champion now
        second = registry.register(tiny_adapter_dir, runs.start(), base=base)
    _rollout_flow(second, str(resolve_model_dir(second.uri, params)), params, str(tiny_model_dir))
    with open_store(params.paths.database_url) as engine:
        rollback(engine, params)
        assert [(a.name, a.model_version) for a in read_arms(engine)] == [(CHAMPION, version.label)]


def test_an_adapter_is_not_promoted_over_a_champion_on_another_base(
    tmp_path, mlflow_store, tiny_model_dir, babbler_dir, tiny_adapter_dir
):
    params = tiny_params(tmp_path)
    registry = Registry(params)
    base = registry.ensure_champion(tiny_model_dir)
    version = registry.register(tiny_adapter_dir, CycleRuns(params).start(), base=base)
    registry.set_alias(CHALLENGER, version.version)
    arms = [  # the champion's arm was pointed at another checkpoint by hand
        Arm(CHAMPION, base.label, str(babbler_dir), "embedded", 0.5),
        Arm(CHALLENGER, version.label, str(tiny_model_dir), "embedded", 0.5, "a2", str(tiny_adapter_dir)),
    ]
    with open_store(params.paths.database_url) as engine:
        replace_arms(engine, arms)
        with pytest.raises(DeployError, match="trained on another base"):
            promote(engine, params)
        assert read_arms(engine) == sorted(arms, key=lambda a: a.name)  # nothing changed
