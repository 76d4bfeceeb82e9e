"""Teams (issue 57): each team its own adapter on the organisation's base, its own cycle, gate and A/B test, over
real HTTP with the embedded backend.

The chain: two teams' keys (and a third team's, and a caller without a team); their users type through the gateway,
served by the organisation's champion; one cycle per team, each training a LoRA adapter on its own rows only and
gated on its own held-out files; the first team's challenger is promoted, so its users are served its adapter; a
team without an adapter gets the organisation's champion; rolling the second team's challenger back leaves the
first team's arms and aliases as they were.
"""

from __future__ import annotations

import time

import httpx
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from flows.cli.main import app as cli
from flows.cycle import online_rl_cycle
from serving.auth import add_key
from serving.gateway import create_app
from serving.simulate import run_simulation
from tasks.core import vocab
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, completions, init_schema, read_arms, replace_arms
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.promote import promote, rollback
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import tracking_client
from tasks.sim.corpus import stdlib_root
from tasks.sim.users import make_users
from tests.serving_util import serve_app
from tests.test_flow_cycle import EVERY_ANSWER_TAKEN, FAST_TRAIN, _dvc_repo, write_cycle_inputs

TEAMS = {"alpha": "asyncio", "beta": "unittest"}  # each team's code base: a stdlib package the tiny base never saw


def _ask(url: str, key: str) -> dict:
    prompt = "<|fim_prefix|>def parse(text):\n    return <|fim_suffix|>\n<|fim_middle|>"
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["tabrl"]


def test_each_team_trains_and_is_served_its_own_adapter(
    tmp_path, tiny_model_dir, fim_samples, typing_regions, mlflow_store, prefect_harness, monkeypatch
):
    repo = _dvc_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    sections = {
        "simulator": EVERY_ANSWER_TAKEN,
        "serving": {"auth": True, "temperature": 1.0, "max_tokens": 1, "config_ttl_s": 0},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": FAST_TRAIN | {"adapter": "lora", "lora_rank": 8},
        "reward": {"advantage": "raw"},
        "evaluate": {"n_samples": 8, "n_requests": 16, "max_new_tokens": 1, "gate_tolerance": 1.0},
        "deploy": {"challenger_share": 0.5},
        "teams": {"sources": {team: str(stdlib_root() / package) for team, package in TEAMS.items()}},
    }
    params, params_file = write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, **sections)
    org = Registry(params).ensure_champion(tiny_model_dir)  # the organisation's champion: the base, version 1
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    base_dir = str(resolve_model_dir(org.uri, params))
    replace_arms(engine, [Arm(CHAMPION, org.label, base_dir, "embedded", 1.0)])

    users = {team: make_users(4, params.simulator, prefix=team) for team in TEAMS}
    keys = {u.user_id: add_key(engine, u.user_id, team=team) for team, group in users.items() for u in group}
    gamma, loner = add_key(engine, "gus", team="gamma"), add_key(engine, "lou")  # no adapter; no team

    def traffic(seed: int) -> None:
        with serve_app(create_app(params, engine=engine)) as url:
            for group in users.values():
                run_simulation(
                    url,
                    typing_regions[seed::2],
                    group,
                    32,
                    api_keys=keys,
                    concurrency=4,
                    seed=seed,
                    traffic=params.traffic,
                    simulator=params.simulator,
                )
        time.sleep(params.ingest.feedback_timeout_s + 0.2)

    traffic(0)
    with engine.connect() as conn:
        logged = dict(conn.execute(sa.select(completions.c.team, sa.func.count()).group_by(completions.c.team)).all())
    assert set(logged) == {"alpha", "beta"}, logged  # every row carries its caller's team

    # One cycle per team: its own rows, its own held-out files, an adapter on the organisation's base.
    reports = {team: online_rl_cycle(str(params_file), [], repo_dir=str(repo), team=team) for team in TEAMS}
    client = tracking_client(params)
    for team, report in reports.items():
        assert report.status == "deployed", (team, report.reason)
        mine = {f"{u.user_id}" for u in users[team]}
        assert set(pq.read_table(report.snapshot).column("user_id").to_pylist()) <= mine  # no other team's rows
        assert f"/teams/{team}/interactions/interactions-{team}-" in report.snapshot
        version = Registry(params, team).aliased(CHALLENGER)
        assert version.label == report.version == f"tabrl-completion.{team}/1"
        tags = client.get_model_version(version.name, "1").tags
        assert tags[vocab.WEIGHTS] == "lora" and tags[vocab.BASE_VERSION] == org.label  # on the org's base
        assert client.get_run(report.run_id).data.tags[vocab.TEAM] == team
        assert (repo / "data" / "teams" / team / "fim" / "typing_test.parquet").is_file()  # gated on its own files
        arms = {a.name: a for a in read_arms(engine, team)}
        assert arms[CHAMPION].model_version == org.label and arms[CHALLENGER].model_version == version.label
    assert read_arms(engine) == [Arm(CHAMPION, org.label, base_dir, "embedded", 1.0)]  # the org's: untouched
    assert Registry(params).aliased(CHALLENGER) is None

    promote(engine, params, team="alpha")
    alpha = Registry(params, "alpha").aliased(CHAMPION)
    assert alpha.label == "tabrl-completion.alpha/1"
    with serve_app(create_app(params, engine=engine)) as url:
        for u in users["alpha"]:  # the team's users get their team's adapter
            assert _ask(url, keys[u.user_id])["model_version"] == alpha.label
        served_beta = {_ask(url, keys[u.user_id])["model_version"] for u in users["beta"]}
        assert served_beta <= {org.label, "tabrl-completion.beta/1"} and alpha.label not in served_beta
        assert _ask(url, gamma)["model_version"] == org.label  # a team without an adapter: the org's champion
        assert _ask(url, loner)["model_version"] == org.label
        metrics = httpx.get(f"{url}/metrics").text
        assert 'arm="champion",team="alpha"' in metrics and 'team="beta"' in metrics

    alpha_arms = read_arms(engine, "alpha")
    rollback(engine, params, team="beta")
    assert read_arms(engine, "beta") == []  # back to the organisation's arms
    assert read_arms(engine, "alpha") == alpha_arms and Registry(params, "alpha").aliased(CHAMPION) == alpha
    assert Registry(params, "beta").aliased(CHALLENGER) is None
    with serve_app(create_app(params, engine=engine)) as url:
        for u in users["beta"]:
            assert _ask(url, keys[u.user_id])["model_version"] == org.label
        assert _ask(url, keys[users["alpha"][0].user_id])["model_version"] == alpha.label

    # What a person sees: every team's arms, and each team's own A/B test.
    runner = CliRunner()
    listed = runner.invoke(cli, ["arms", "--params", str(params_file)])
    assert listed.exit_code == 0 and "alpha" in listed.output and "tabrl-completion.alpha/1" in listed.output
    teams = runner.invoke(cli, ["teams", "list", "--params", str(params_file)])
    assert teams.exit_code == 0, teams.output
    assert all(name in teams.output for name in ("alpha", "beta", "gamma")), teams.output
    engine.dispose()


@pytest.mark.parametrize("name", ["Alpha", "a b", "-x", "x" * 33])
def test_a_malformed_team_name_is_refused_with_what_a_name_may_be(tmp_path, name):
    params = tiny_params_with_store(tmp_path)
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    with pytest.raises(ValueError, match="1-32 characters of a-z, 0-9"):
        add_key(engine, "ann", team=name)
    result = CliRunner().invoke(cli, ["cycle", "--team", name])
    assert result.exit_code == 2 and "1-32 characters" in result.output
    engine.dispose()


def tiny_params_with_store(tmp_path):
    from tests.conftest import tiny_params

    return tiny_params(tmp_path)
