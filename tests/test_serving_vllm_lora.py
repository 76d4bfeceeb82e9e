"""The real-model chain on a real vLLM (CPU build): SmolLM2-135M, a LoRA cycle, one server for every arm.

1. SmolLM2 imported (fixture) and served as champion by its base's one vLLM server (--enable-lora);
2. simulated users type through the gateway; one real cycle trains a LoRA candidate on their outcomes;
3. the candidate is registered with its base (tagged, checked);
4. it goes live on the same server (loaded at runtime under a new name, probed): no new server;
5. the gateway serves both arms, sending `model=<name>`, and logs the adapter's version;
6. the server restarts: the live adapter is loaded again from the arms table on the next request;
7. two teams' versions go live on the same server, each served to its own team's callers only (issue 57);
8. rollback unloads them.

Slow (a 135M model, a vLLM start and a restart: minutes on 2 cores) and required in CI: it needs
TABRL_TEST_VLLM_PYTHON (`.ci/vllm-venv.sh`), and TABRL_REQUIRE_VLLM=1 turns a missing venv into a failure.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prefect import flow

from flows.cycle import online_rl_cycle
from serving.gateway import create_app
from serving.simulate import run_simulation
from tasks.core import vocab
from tasks.core.adapters import is_adapter
from tasks.core.store import CHALLENGER, CHAMPION, completions, open_store, read_arms
from tasks.core.teams import ORG
from tasks.core.vllm import recorded_servers, served_models, start_vllm, stop_vllm
from tasks.deploy.arms import serve_champion, sync_adapters
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.promote import rollback
from tasks.deploy.registry import Registry
from tasks.deploy.rollout import rollout
from tasks.deploy.tracking import tracking_client
from tasks.sim.users import make_users
from tests.serving_util import serve_app
from tests.test_flow_cycle import EVERY_ANSWER_TAKEN, _dvc_repo, write_cycle_inputs
from tests.test_serving_vllm import VLLM_CPU_ARGS

pytestmark = pytest.mark.slow


@flow
def _rollout_flow(version, model_dir, params, base_dir, team=ORG):
    return rollout(version, model_dir, params, base_dir, team)


def _ask(url: str, arm: str, prompt: str, team: str = ORG) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "user": "u", "max_tokens": 4, "temperature": 0},
        headers={"X-Tabrl-Arm": arm, "X-Tabrl-Team": team},
        timeout=120,
    )


def test_a_lora_version_goes_live_on_the_one_vllm_server_and_survives_a_restart(
    vllm_python,
    smollm2_dir,
    tmp_path,
    typing_regions,
    fim_samples,
    mlflow_store,
    prefect_harness,
    monkeypatch,
):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    repo = _dvc_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    sections = {
        "model": {"base_dir": str(smollm2_dir)},
        "simulator": EVERY_ANSWER_TAKEN,
        "serving": {
            "auth": False,
            "temperature": 1.0,
            "max_tokens": 4,
            "config_ttl_s": 0,
            "backend": "vllm",
            "vllm_python": vllm_python,
            "vllm_args": [*VLLM_CPU_ARGS, "--logprobs-mode", "processed_logprobs"],
            "vllm_max_lora_rank": 8,
        },
        "traffic": {"max_prefix_chars": 160, "max_suffix_chars": 40},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": {"adapter": "lora", "lora_rank": 8, "lr": 1e-3, "epochs": 1, "min_rows": 4, "micro_batch": 4}
        | {"grad_accum": 1},
        "evaluate": {"n_samples": 4, "n_requests": 8, "max_new_tokens": 4, "batch_size": 4, "gate_tolerance": 1.0},
    }
    params, params_file = write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, n_samples=4, **sections)
    registry = Registry(params)
    try:
        champion_arm = serve_champion(params)  # SmolLM2 is version 1, on its base's one LoRA server
        (server,) = recorded_servers(params)
        assert champion_arm.model_uri == server.url and server.lora
        with open_store(params.paths.database_url) as engine, serve_app(create_app(params, engine=engine)) as url:
            run_simulation(
                url,
                typing_regions,
                make_users(2, params.simulator),
                12,
                api_keys=None,
                concurrency=2,
                seed=0,
                traffic=params.traffic,
                simulator=params.simulator,
            )
        time.sleep(params.ingest.feedback_timeout_s + 0.2)

        report = online_rl_cycle(str(params_file), [], repo_dir=str(repo))
        assert report.status in ("deployed", "gate_failed"), report.reason
        candidate = Path(params.paths.models_dir) / "candidates" / report.run_id
        assert is_adapter(candidate)  # a LoRA candidate: MBs, not a copy of the base
        base = registry.aliased(CHAMPION)
        if report.status == "deployed":  # the gate's call on 12 requests of traffic; the chain goes on either way
            version = registry.aliased(CHALLENGER)
        else:
            version = registry.register(candidate, report.run_id, base=base)
            base_dir = str(resolve_model_dir(base.uri, params))
            _rollout_flow(version, str(resolve_model_dir(version.uri, params)), params, base_dir)
        tags = tracking_client(params).get_model_version(version.name, str(version.version)).tags
        assert tags[vocab.BASE_VERSION] == base.label  # registered with its base

        with open_store(params.paths.database_url) as engine:
            arms = {a.name: a for a in read_arms(engine)}
        challenger = arms[CHALLENGER]
        assert recorded_servers(params) == [server]  # no new server: the version was loaded into the base's one
        assert challenger.model_uri == server.url and challenger.adapter
        assert served_models(server.url)[challenger.served_model]["parent"] == server.model_dir

        prompt = "def add(a, b):\n    return"
        with open_store(params.paths.database_url) as engine, serve_app(create_app(params, engine=engine)) as url:
            answers = {arm: _ask(url, arm, prompt) for arm in (CHAMPION, CHALLENGER)}
            assert [a.status_code for a in answers.values()] == [200, 200], answers[CHALLENGER].text
            # a prefix-only model at the top of a file: vLLM, which refuses an empty prompt, gets start-of-text
            empty = {arm: _ask(url, arm, "") for arm in (CHAMPION, CHALLENGER)}
            assert [a.status_code for a in empty.values()] == [200, 200], empty[CHAMPION].text
            with engine.connect() as conn:
                rows = {r.id: r for r in conn.execute(sa.select(completions))}
            logged = rows[answers[CHALLENGER].json()["id"]]
            assert (logged.arm, logged.model_version) == (CHALLENGER, version.label)  # the adapter's version

            stop_vllm(server.pid)  # the server restarts (same address) and has lost its runtime adapters
            restarted = start_vllm(server.model_dir, params, lora=True, port=server.port)
            assert challenger.served_model not in served_models(restarted.url)
            # the gateway loads it again from the arms table, once, though several requests ask at the same time
            with ThreadPoolExecutor(4) as pool:
                again = list(pool.map(lambda _: _ask(url, CHALLENGER, prompt), range(4)))
            for answer in again:
                assert answer.status_code == 200 and answer.json()["tabrl"]["arm"] == CHALLENGER, answer.text
        assert challenger.served_model in served_models(restarted.url)
        assert sync_adapters(params) == []  # nothing left to load

        # Two teams' versions (the same adapter, registered for each) on the same server: no new one.
        teams = {}
        for team in ("alpha", "beta"):
            mine = Registry(params, team).register(candidate, report.run_id, base=base)
            _rollout_flow(mine, str(resolve_model_dir(mine.uri, params)), params, str(server.model_dir), team)
            with open_store(params.paths.database_url) as engine:
                teams[team] = {a.name: a for a in read_arms(engine, team)}[CHALLENGER]
            assert teams[team].model_version == mine.label and teams[team].model_uri == restarted.url
        assert [s.url for s in recorded_servers(params)] == [restarted.url]
        loaded = served_models(restarted.url)
        assert {challenger.served_model, teams["alpha"].served_model, teams["beta"].served_model} <= set(loaded)
        with open_store(params.paths.database_url) as engine, serve_app(create_app(params, engine=engine)) as url:
            for team, arm in teams.items():
                answer = _ask(url, CHALLENGER, prompt, team)
                assert answer.status_code == 200 and answer.json()["tabrl"]["model_version"] == arm.model_version
            assert _ask(url, CHALLENGER, prompt).json()["tabrl"]["model_version"] == version.label  # the org's

        with open_store(params.paths.database_url) as engine:
            rollback(engine, params)
            assert [a.name for a in read_arms(engine)] == [CHAMPION]
            for team in teams:
                rollback(engine, params, team=team)
                assert read_arms(engine, team) == []  # back to the organisation's arms
        loaded = served_models(restarted.url)
        assert challenger.served_model not in loaded  # unloaded
        assert not {arm.served_model for arm in teams.values()} & set(loaded)
    finally:
        for running in recorded_servers(params):
            stop_vllm(running.pid)
