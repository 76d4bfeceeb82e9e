"""The serving engines (tasks/core/engines): one per backend, in one registry, and a third one plugs in.

The fake engine below is defined here and registered under its own name, and nothing outside this module
changes: the champion is served on it, the gateway completes through its backend, a rollout serves a version
on it (and a failing one is undone by it), the rollback retires on it, a decision resyncs it, and an
evaluation types with it, its identity in the completion cache's key.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import httpx
import pytest
from prefect import flow

import tasks.core.config.operations as operations
import tasks.deploy.rollout as rollout_mod
from tasks.core.config import BACKENDS, BackendName
from tasks.core.engines import ENGINES, engine_class, make_backend, open_engine
from tasks.core.engines.base import Sampling, Served
from tasks.core.fim import QWEN, FimTemplate
from tasks.core.generate import Generation
from tasks.core.store import CHALLENGER, CHAMPION, ArmError, Store, init_schema, read_arms, replace_arms
from tasks.deploy.arms import serve_champion, sync_adapters
from tasks.deploy.errors import DeployError
from tasks.deploy.promote import rollback
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.deploy.tracking import CycleRuns
from tasks.evaluate.completions import model_key
from tests.conftest import tiny_params
from tests.serving_util import serve_app

CALLS: list[tuple] = []  # what the fake engine was asked, in order


class FakeBackend:
    def __init__(self, arm) -> None:
        self.arm = arm

    async def template(self) -> FimTemplate:
        return QWEN

    async def complete(self, prompt: str, sampling: Sampling, on_text=None) -> Generation:
        CALLS.append(("complete", self.arm.model_version))
        return Generation(f"fake:{self.arm.model_version}", [1, 2], [-0.1, -0.2])

    async def aclose(self) -> None:
        return None


@dataclass
class FakeTyping:
    template: FimTemplate = QWEN

    def samples_per_call(self, batch_size: int) -> int:
        return batch_size

    def complete(self, prompts, max_new_tokens, temperature=0.0, seed=0, rule=None) -> list[Generation]:
        return [Generation("pass", [3], [-0.5]) for _ in prompts]


class Fake:
    name = "fake"
    remote = True

    def __init__(self, params) -> None:
        self.params = params

    def serve(self, label: str, model_dir: str, base_dir: str | None) -> Served:
        CALLS.append(("serve", label))
        return Served(f"fake://{label}", f"served-{label}")

    def unserve(self, served: Served) -> None:
        CALLS.append(("unserve", served.model_uri))

    def serve_champion(self, label: str, champion_dir: str, base_dir: str) -> Served:
        CALLS.append(("serve_champion", label))
        return Served(f"fake://{label}", f"served-{label}")

    def retire(self, arm, live) -> str | None:
        if (arm.model_uri, arm.served_model) in {(a.model_uri, a.served_model) for a in live}:
            return None  # a share change: still served
        CALLS.append(("retire", arm.model_version))
        return f"retired {arm.model_version}"

    def resync(self, arm) -> str | None:
        CALLS.append(("resync", arm.model_version))
        return None

    @contextlib.contextmanager
    def evaluation(self, model_dir: Path, base_dir):
        CALLS.append(("evaluation", model_dir.name))
        yield FakeTyping()

    def identity(self, adapter: bool) -> dict:
        return {"backend": self.name, "adapter": "fake" if adapter else ""}

    @staticmethod
    def base_of(arm) -> str:
        return arm.model_uri

    @staticmethod
    def backend(arm, timeout_s: float) -> FakeBackend:
        return FakeBackend(arm)


@pytest.fixture
def fake_engine(monkeypatch):
    """The fake's registry entry: its class in ENGINES and its name among the backends the store accepts."""
    monkeypatch.setitem(ENGINES, "fake", Fake)
    monkeypatch.setattr(operations, "BACKENDS", (*BACKENDS, "fake"))
    CALLS.clear()
    yield Fake


def _on_fake(params):
    # serving.backend is a Literal of the shipped engines: the fake is set past validation, as its entry would
    return params.model_copy(update={"serving": params.serving.model_copy(update={"backend": "fake"})})


@flow
def _rollout_flow(version, model_dir, params):
    return rollout(version, model_dir, params)


def test_the_registry_holds_one_engine_per_backend_name_and_refuses_others():
    assert set(ENGINES) == set(get_args(BackendName)) == set(BACKENDS)
    assert {name: cls.name for name, cls in ENGINES.items()} == {"embedded": "embedded", "vllm": "vllm"}
    with pytest.raises(ValueError, match="no serving engine 'sglang': registered are embedded, vllm"):
        engine_class("sglang")


def test_the_store_refuses_an_arm_on_an_engine_no_one_registered(tmp_path, tiny_model_dir):
    from tasks.core.store import Arm

    engine = Store(f"sqlite:///{tmp_path}/tabrl.db").engine
    init_schema(engine)
    with pytest.raises(ArmError, match="backend 'sglang' is not a serving engine: one of embedded, vllm"):
        replace_arms(engine, [Arm(CHAMPION, "m/1", str(tiny_model_dir), "sglang", 1.0)])  # type: ignore[arg-type]
    assert read_arms(engine) == []


def test_a_third_engine_plugs_in_with_one_registry_entry(
    fake_engine, tmp_path, mlflow_store, tiny_model_dir, prefect_harness, monkeypatch
):
    params = _on_fake(tiny_params(tmp_path, serving={"auth": False, "config_ttl_s": 0, "min_logprob": None}))
    store = Store(params.paths.database_url).engine
    init_schema(store)
    registry = Registry(params)

    champion = serve_champion(params)  # the registry's champion, on the fake
    assert (champion.backend, champion.model_uri, champion.served_model) == (
        "fake",
        "fake://tabrl-completion/1",
        "served-tabrl-completion/1",
    )
    assert read_arms(store) == [champion]

    from serving.gateway import create_app

    with serve_app(create_app(params, engine=store)) as url:  # the gateway's default factory: the arm's engine
        r = httpx.post(url + "/v1/completions", json={"prompt": QWEN.render("def f(", ")"), "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "fake:tabrl-completion/1"

    version = registry.register(tiny_model_dir, CycleRuns(params).start())
    done = _rollout_flow(version, str(tiny_model_dir), params)
    assert done.served == Served(f"fake://{version.label}", f"served-{version.label}")
    assert {a.name: a.backend for a in read_arms(store)} == {CHAMPION: "fake", CHALLENGER: "fake"}

    @rollout_mod.task(name="check-arms")
    def failing_check(expected, params, team):
        raise DeployError("injected")

    second = registry.register(tiny_model_dir, CycleRuns(params).start())
    with monkeypatch.context() as m:
        m.setattr(rollout_mod, "check_arms", failing_check)
        with pytest.raises(DeployError, match="injected"):
            _rollout_flow(second, str(tiny_model_dir), params)
    assert ("unserve", f"fake://{second.label}") in CALLS  # the engine undid what it served
    assert [a.model_version for a in read_arms(store) if a.name == CHALLENGER] == [version.label]

    assert sync_adapters(params) == []
    change = rollback(store, params)
    assert change.action == "rollback" and [a.name for a in read_arms(store)] == [CHAMPION]

    with open_engine(tiny_model_dir, params) as typing:
        assert [g.text for g in typing.complete(["a", "b"], 8)] == ["pass", "pass"]
        key = model_key(tiny_model_dir, typing, params)
    shipped = tiny_params(tmp_path)
    with open_engine(tiny_model_dir, shipped) as in_process:
        assert model_key(tiny_model_dir, in_process, shipped) != key  # the engine is part of the cache key

    asked = [c for c in CALLS if c[0] != "complete"]
    assert asked == [
        ("serve_champion", "tabrl-completion/1"),
        ("serve", version.label),
        ("serve", second.label),
        ("unserve", f"fake://{second.label}"),
        ("resync", version.label),  # the arms by name: challenger, champion
        ("resync", "tabrl-completion/1"),
        ("retire", version.label),
        ("evaluation", tiny_model_dir.name),
    ]
    assert ("complete", "tabrl-completion/1") in CALLS and make_backend(champion, 1.0).arm == champion


def test_seeded_requests_on_two_checkpoints_at_once_draw_as_they_would_alone(tmp_path, tiny_model_dir):
    """Two arms on two checkpoints generate in two threads at once (the demo's A/B test). torch has one generator per
    process, so a seeded request holds it for its whole generation: each suggestion is the one it is alone."""
    import asyncio
    import shutil

    from tasks.core.engines.embedded import EmbeddedBackend

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    arms = [EmbeddedBackend(tiny_model_dir), EmbeddedBackend(other)]
    prompts = [QWEN.render(f"def f{i}(x):\n    return x", "\n") for i in range(6)]
    asks = [(arm, p, Sampling(12, 1.0, seed=100 * j + i)) for j, arm in enumerate(arms) for i, p in enumerate(prompts)]

    async def alone() -> list[list[int]]:
        return [(await arm.complete(p, s)).token_ids for arm, p, s in asks]

    async def together() -> list[list[int]]:
        return [g.token_ids for g in await asyncio.gather(*(arm.complete(p, s) for arm, p, s in asks))]

    try:
        one_by_one = asyncio.run(alone())
        assert asyncio.run(together()) == one_by_one
        assert len({tuple(ids) for ids in one_by_one}) > 6  # sampled at T = 1: the seeds, not greedy decoding, agree
    finally:
        for arm in arms:
            asyncio.run(arm.aclose())
