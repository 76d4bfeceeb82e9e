"""The whole online_rl_cycle under Prefect's harness: tiny model, gateway on loopback, SQLite,
MLflow on a temp store, DVC in a temp git repo.

Simulated users of this test accept every shown suggestion and the tiny champion greedily abstains
(end of text is its likeliest first token, at about 4 %), so the traffic teaches the candidate to
suggest: a measurable improvement the gate can see. Suggestions are one token long, in serving and
in the evaluation: a longer one would end with an end-of-text token that every accepted suggestion
rewards, and the candidate would greedily show a blank then stop (a blank counts as no suggestion).
"""

import os
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from flows.cycle import online_rl_cycle
from serving.gateway import create_app
from serving.simulate import run_simulation
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, init_schema, read_arms, replace_arms
from tasks.deploy.model_cache import candidate_dir, resolve_model_dir
from tasks.deploy.promote import rollback
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import CycleRuns
from tasks.ingest.versioning import ensure_repo
from tasks.sim.corpus import write_samples
from tasks.sim.editor import regions_path, write_regions
from tasks.sim.users import make_users
from tests.conftest import tiny_params
from tests.serving_util import serve_app

# A big, quick update the gate can see on a tiny model (shared by the cycle tests). At lr 1e-2 a step's approx-KL
# sometimes passes 20 (21.95 at step 16 in one CI run): such a step ends the update early (target_kl, checkpoint kept)
# instead of failing the cycle as diverged; the guard that stops a job has its own tests (test_train_job.py).
FAST_TRAIN = {
    "lr": 1e-2,
    "max_approx_kl": 1e3,
    "target_kl": 20.0,
    "epochs": 4,
    "min_rows": 8,
    "micro_batch": 8,
    "grad_accum": 1,
}
ACCEPT_ALL = [{"name": "easy", "weight": 1.0, "min_accept_chars": 1, "p_accept_wrong": 1.0, "p_ignore_right": 0.0}]
# Users who take every suggestion they see, in an editor that waits for every answer: the pipeline's tests need
# outcomes on every request, whatever the machine's pace (the Continue-like editor is tests/test_simulator_http.py's).
EVERY_ANSWER_TAKEN = {"personas": ACCEPT_ALL, "client": "waits"}


def _dvc_repo(path):
    assert not path.exists()
    return ensure_repo(path)  # git + DVC, an identity of its own (CI may have none)


def write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, n_samples: int = 16, **sections):
    """(params, params file) of a cycle test, snapshots inside the DVC repo, with its held-out FIM samples and
    typing regions written where the cycle reads them."""
    paths = {"data_dir": str(repo / "data"), "snapshots_repo": str(repo)}
    sections = {**sections, "paths": {**paths, **sections.get("paths", {})}}
    params = tiny_params(tmp_path, **sections)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    test = [dict(s, split="test") for s in fim_samples[:n_samples]]
    write_samples(test, repo / params.paths.data_dir / "fim" / "test.parquet")
    write_regions(typing_regions, regions_path(repo / params.paths.data_dir, "test"), params.traffic)
    return params, params_file


def champion_serving_traffic(base_dir, params, regions, n_users: int, n_requests: int):
    """The base registered as champion and served alone, then n_requests of simulated typing through the gateway;
    returns (champion version, log store engine)."""
    champion = Registry(params).ensure_champion(base_dir)
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm(CHAMPION, champion.label, str(resolve_model_dir(champion.uri, params)), "embedded", 1.0)])
    with serve_app(create_app(params, engine=engine, auth=False)) as url:
        users = make_users(n_users, params.simulator)
        run_simulation(
            url,
            regions,
            users,
            n_requests,
            api_keys=None,
            concurrency=n_users,
            seed=0,
            traffic=params.traffic,
            simulator=params.simulator,
        )
    return champion, engine


def test_cycle_registers_and_rolls_out_a_challenger(
    tmp_path, tiny_model_dir, fim_samples, typing_regions, mlflow_store, prefect_harness, monkeypatch
):
    repo = _dvc_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")  # the training's system metrics, each second
    sections = {
        "simulator": EVERY_ANSWER_TAKEN,
        "serving": {"auth": False, "temperature": 1.0, "max_tokens": 1},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": FAST_TRAIN,
        "reward": {"advantage": "raw"},  # every shown suggestion is accepted: raw rewards push away from abstaining
        "evaluate": {"n_samples": 16, "n_requests": 32, "max_new_tokens": 1, "gate_tolerance": 1.0},
        "deploy": {"challenger_share": 0.3},
    }
    params, params_file = write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, **sections)
    registry = Registry(params)

    champion, engine = champion_serving_traffic(tiny_model_dir, params, typing_regions, 4, 48)
    import time

    time.sleep(params.ingest.feedback_timeout_s + 0.2)
    retired = candidate_dir(params, "an-earlier-cycle")  # a candidate nothing serves, past the retention
    retired.mkdir(parents=True)
    long_ago = time.time() - (params.deploy.retired_retention_hours + 1) * 3600
    os.utime(retired, (long_ago, long_ago))

    report = online_rl_cycle(str(params_file), [], repo_dir=str(repo))
    assert not retired.exists(), "the cycle runs the model retention"
    assert candidate_dir(params, report.run_id).is_dir()  # its own candidate is young

    snapshot = Path(report.snapshot)
    assert snapshot.is_file() and snapshot.with_name(snapshot.name + ".dvc").is_file(), "versioned with DVC"
    run = mlflow.get_run(report.run_id)
    for key in ("ingest/rows", "eval/reward_per_request", "eval/champion/reward_per_request", "train/loss"):
        assert key in run.data.metrics, key
    assert run.data.params["train.lr"] == "0.01" and run.data.tags["tabrl.cycle_status"] == report.status
    assert any(k.startswith("system/") and k.endswith("/cpu_utilization_percentage") for k in run.data.metrics)
    (trained_on,) = run.inputs.dataset_inputs  # the snapshot, as the run's dataset (the MLflow UI's Datasets)
    assert trained_on.dataset.name.endswith(snapshot.name) and trained_on.tags[0].value == "training"
    assert report.status == "deployed", report.reason
    version = registry.aliased(CHALLENGER)
    assert version is not None and version.label == report.version and version.version == champion.version + 1
    arms = {a.name: a for a in read_arms(engine)}
    assert arms[CHALLENGER].share == pytest.approx(0.3) and arms[CHAMPION].share == pytest.approx(0.7)
    assert arms[CHALLENGER].model_version == version.label

    # What a person sees in the MLflow UI: the runs view (not GenAI), the run named for its outcome, the
    # snapshot's DVC hash, and a version page that links the run, the snapshot and the gate's numbers.
    client = MlflowClient()
    experiment = client.get_experiment_by_name(params.deploy.experiment)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.info.run_name == f"cycle 1 · deployed · {version.label}" and run.data.tags["tabrl.cycle"] == "1"
    assert run.data.tags["tabrl.version"] == version.label and run.data.tags["tabrl.cycle_reason"] == report.reason
    md5 = yaml.safe_load(snapshot.with_name(snapshot.name + ".dvc").read_text())["outs"][0]["md5"]
    assert run.data.tags["tabrl.snapshot_dvc_md5"] == md5 and run.data.tags["tabrl.snapshot"].endswith(snapshot.name)
    registered = client.get_model_version(version.name, str(version.version))
    description = registered.description
    m = report.metrics
    # the promoted version names the lineage's characters-saved holder the next gate types too: itself if it
    # saved at least what the base did (no tag), else the base
    if m["eval/typing/chars_saved"] >= m["eval/champion/typing/chars_saved"]:
        assert "tabrl.chars_saved_holder" not in registered.tags and registry.chars_saved_holder(version) is None
    else:
        assert registered.tags["tabrl.chars_saved_holder"] == str(champion.version)
        assert registry.chars_saved_holder(version).version == champion.version
    assert registry.chars_saved_holder(champion) is None  # the base holds its own
    # the gate typed the first window of the held-out half; the next gate takes the next one
    assert run.data.tags["tabrl.gate_window"] == "0" and params.evaluate.gate_windows == 3
    assert CycleRuns(params).next_gate_window(3) == 1
    gate_row = (
        f"| reward_per_request | {m['eval/typing/reward_per_request']:.4g} "
        f"| {m['eval/champion/typing/reward_per_request']:.4g} |"
    )
    assert f"/runs/{report.run_id})" in description and md5 in description and gate_row in description

    again = online_rl_cycle(str(params_file), [], repo_dir=str(repo))  # the challenger is still under test
    assert again.status == "skipped" and again.reason == "challenger under test"
    skipped = client.get_run(again.run_id)  # a skipped cycle leaves a run too: MLflow counts every cycle
    assert skipped.info.run_name == "cycle 2 · skipped: challenger under test" and skipped.info.status == "FINISHED"
    assert skipped.data.tags["tabrl.cycle_status"] == "skipped"

    # More traffic, then a forced cycle whose update trips the approx-KL guard: the champion and the
    # challenger under test stay as they are, and the run says why.
    with serve_app(create_app(params, engine=engine, auth=False)) as url:
        run_simulation(
            url,
            typing_regions[::-1],
            make_users(4, params.simulator),
            48,
            api_keys=None,
            concurrency=4,
            seed=1,
            traffic=params.traffic,
            simulator=params.simulator,
        )
    time.sleep(params.ingest.feedback_timeout_s + 0.2)
    # (raw rewards with abstaining worth 1: every row moves the weights, so step 2's approx-KL is > 0)
    trip = ["train.max_approx_kl=1e-9", "reward.advantage=raw", "reward.abstained=1.0", "reward.rejected=-1.0"]
    diverged = online_rl_cycle(str(params_file), trip, force=True, repo_dir=str(repo))
    assert diverged.status == "diverged" and "approx" in diverged.reason.lower(), diverged.reason
    assert registry.aliased(CHALLENGER).label == version.label
    assert {a.name: a.model_version for a in read_arms(engine)} == {n: a.model_version for n, a in arms.items()}
    assert mlflow.get_run(diverged.run_id).data.tags["tabrl.cycle_status"] == "diverged"
    # no gate ran in cycles 2 and 3: the next one still takes window 1
    assert CycleRuns(params).next_gate_window(3) == 1

    # Rolled back by hand: the A/B decision joins the story on the cycle run's name and the version page.
    rollback(engine, params)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.run_name for r in runs] == [
        f"base model · {champion.label}",
        f"cycle 1 · deployed · {version.label} → rolled back",
        "cycle 2 · skipped: challenger under test",
        "cycle 3 · diverged",
    ]
    description = client.get_model_version(version.name, str(version.version)).description
    assert "A/B decision: **rolled back**: by hand" in description and "p-values:" in description
