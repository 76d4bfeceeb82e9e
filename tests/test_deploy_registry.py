"""MLflow on a temp SQLite store: cycle runs (tracking.py); versions, aliases, models:/ -> local dir (registry.py)."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.core.store import CHALLENGER, CHAMPION
from tasks.deploy.errors import DeployError
from tasks.deploy.model_cache import CACHE_DONE, resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import CycleRuns, as_flat_tags, mlflow_params, tracking_client
from tests.conftest import tiny_params


def test_cycle_run_logs_every_param_within_mlflow_limits_and_resumes(tmp_path, mlflow_store):
    params = tiny_params(tmp_path, data={"split_salt": "s" * 7000})  # longer than MLflow's 6000-char limit
    runs = CycleRuns(params)
    run_id = runs.start(snapshot_sha256="ab" * 32, run_name="cycle-1")
    runs.end(run_id)

    run = tracking_client(params).get_run(run_id)
    assert set(run.data.params) == set(params.flat())
    assert len(run.data.params["data.split_salt"]) <= 6000
    assert run.data.params["data.split_salt"].endswith("]") and "sha256:" in run.data.params["data.split_salt"]
    assert run.data.params["deploy.min_samples"] == str(params.deploy.min_samples)
    assert run.data.tags["tabrl.snapshot_sha256"] == "ab" * 32
    assert run.info.status == "FINISHED"
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path)  # artifacts under state_dir

    # Resume: same params is fine and reopens the run; other params would make the run incomparable.
    assert runs.start(run_id=run_id) == run_id
    assert tracking_client(params).get_run(run_id).info.status == "RUNNING"
    other = tiny_params(tmp_path, data={"split_salt": "s" * 7000}, deploy={"min_samples": 7})
    with pytest.raises(DeployError, match="deploy.min_samples"):
        CycleRuns(other).start(run_id=run_id)
    with pytest.raises(DeployError, match="not found"):
        runs.start(run_id="0" * 32)


def test_mlflow_params_are_strings_and_distinct_long_values_stay_distinct(tmp_path):
    a = mlflow_params(tiny_params(tmp_path, data={"split_salt": "x" * 7000}))
    b = mlflow_params(tiny_params(tmp_path, data={"split_salt": "x" * 6999 + "y"}))
    assert all(isinstance(v, str) for v in a.values())
    assert a["data.split_salt"] != b["data.split_salt"]


def test_register_versions_aliases_and_resolve_to_loadable_dirs(tmp_path, mlflow_store, tiny_model_dir):
    params = tiny_params(tmp_path)
    registry = Registry(params)
    name = params.deploy.registered_model
    assert registry.aliased(CHAMPION) is None  # no registered model yet

    base = registry.ensure_champion(tiny_model_dir)
    assert (base.version, base.label) == (1, f"{name}/1")
    assert registry.ensure_champion(tiny_model_dir) == base  # idempotent: no second base version

    run_id = CycleRuns(params).start(snapshot_sha256="cd" * 32)
    cand = registry.register(tiny_model_dir, run_id)
    assert cand.version == 2 and cand.run_id == run_id and cand.uri == f"models:/{name}/2"
    mv = tracking_client(params).get_model_version(name, "2")
    assert mv.tags["tabrl.snapshot_sha256"] == "cd" * 32

    registry.set_alias(CHALLENGER, cand.version)
    assert registry.aliased(CHALLENGER) == cand
    assert registry.aliased(CHAMPION) == base

    # Local artifact store: the alias resolves to the registered artifact itself, no copy.
    local = resolve_model_dir(f"models:/{name}@{CHALLENGER}", params)
    assert str(local) == cand.source.removeprefix("file://")
    assert local.is_relative_to(tmp_path / "state" / "mlartifacts")
    model = AutoModelForCausalLM.from_pretrained(local)
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    assert AutoTokenizer.from_pretrained(local)("def f():")["input_ids"]

    # A private copy (what a remote store always gets): downloaded once into the cache, then reused.
    copied = resolve_model_dir(f"models:/{name}/{base.version}", params, copy=True)
    assert copied == tmp_path / "state" / "model_cache" / name / "1" and (copied / CACHE_DONE).is_file()
    AutoModelForCausalLM.from_pretrained(copied)
    (copied / "marker").write_text("kept")
    assert resolve_model_dir(f"models:/{name}/1", params, copy=True) == copied and (copied / "marker").exists()

    assert resolve_model_dir(tiny_model_dir, params) == tiny_model_dir
    assert registry.delete_alias(CHALLENGER) and not registry.delete_alias(CHALLENGER)
    with pytest.raises(DeployError, match="cannot resolve"):
        resolve_model_dir(f"models:/{name}@{CHALLENGER}", params)
    with pytest.raises(DeployError, match="no config.json"):
        registry.register(tmp_path, run_id)


def test_ensure_champion_refuses_a_registry_that_lost_its_champion(tmp_path, mlflow_store, tiny_model_dir):
    params = tiny_params(tmp_path)
    registry = Registry(params)
    registry.ensure_champion(tiny_model_dir)
    registry.delete_alias(CHAMPION)
    with pytest.raises(DeployError, match="no 'champion' alias"):
        registry.ensure_champion(tiny_model_dir)


def test_cycle_runs_are_numbered_and_named_for_their_outcome_in_a_runs_first_experiment(
    tmp_path, mlflow_store, tiny_model_dir
):
    params = tiny_params(tmp_path)
    client = tracking_client(params)
    base = Registry(params).ensure_champion(tiny_model_dir)
    exp = client.get_experiment_by_name(params.deploy.experiment)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow's UI opens on the runs
    assert "one run per cycle" in exp.tags["mlflow.note.content"]
    link = CycleRuns(params).runs_view_url("http://127.0.0.1:5000/")  # MLflow 3.17's UI reads its switch, not the tag
    assert link == f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    assert client.get_run(base.run_id).info.run_name == f"base model · {base.label}"

    first, second, third = (CycleRuns(params).start() for _ in range(3))  # the base run is not a cycle
    assert [client.get_run(r).data.tags["tabrl.cycle"] for r in (first, second, third)] == ["1", "2", "3"]
    assert client.get_run(third).info.run_name == "cycle 3"  # until its outcome is known
    CycleRuns(params).name_outcome(first, "skipped", "too few rows to train on (3 < train.min_rows=8)")
    CycleRuns(params).name_outcome(second, "gate_failed", "judge_mean drops -1.2; FAIL: the champion stays")
    CycleRuns(params).name_outcome(third, "deployed", "reward improves", "tabrl-completion/2")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    assert [runs[r].info.run_name for r in (first, second, third)] == [
        "cycle 1 · skipped: too few rows to train on",
        "cycle 2 · gate failed",
        "cycle 3 · deployed · tabrl-completion/2",
    ]
    assert runs[second].data.tags["tabrl.cycle_status"] == "gate_failed"
    assert runs[second].data.tags["tabrl.cycle_reason"].startswith("judge_mean drops")
    assert (
        runs[third].data.tags["tabrl.version"] == "tabrl-completion/2" and "tabrl.version" not in runs[second].data.tags
    )

    # An experiment made before tabrl set its kind (by hand, an older tabrl) gets the kind on first use.
    other = tiny_params(tmp_path, deploy={"experiment": "made-by-hand"})
    made = client.create_experiment("made-by-hand")
    assert (
        CycleRuns(other).start()
        and client.get_experiment(made).tags["mlflow.experimentKind"] == "custom_model_development"
    )


def test_a_version_description_links_its_run_snapshot_and_gate(tmp_path, mlflow_store, tiny_model_dir):
    params = tiny_params(tmp_path)
    registry = Registry(params)
    client = tracking_client(params)
    base = registry.ensure_champion(tiny_model_dir)
    base_text = client.get_model_version(base.name, str(base.version)).description
    assert f"/runs/{base.run_id})" in base_text and "base model" in base_text

    run_id = CycleRuns(params).start()
    client.log_batch(
        run_id,
        tags=as_flat_tags({"tabrl.snapshot": "data/interactions/x.parquet", "tabrl.snapshot_dvc_md5": "f" * 32}),
    )
    gate = {
        "candidate/reward_per_request": 0.25,
        "champion/reward_per_request": 0.125,
        "delta/reward_per_request": 0.125,
    }
    cand = registry.register(tiny_model_dir, run_id, gate=gate)
    mv = client.get_model_version(cand.name, str(cand.version))
    exp = client.get_run(run_id).info.experiment_id
    assert f"[cycle 1](#/experiments/{exp}/runs/{run_id})" in mv.description
    assert "`data/interactions/x.parquet`" in mv.description and "f" * 32 in mv.description
    assert "| reward_per_request | 0.25 | 0.125 | 0.125 | - | - |" in mv.description
    assert mv.tags["tabrl.snapshot_dvc_md5"] == "f" * 32 and mv.tags["tabrl.snapshot"] == "data/interactions/x.parquet"

    registry.append_description(cand, "A/B decision: **promoted**.")
    after = client.get_model_version(cand.name, str(cand.version)).description
    assert after.startswith(mv.description) and after.endswith("\n\nA/B decision: **promoted**.")


def test_mlflow_loads_the_champion_and_an_adapter_version_in_a_fresh_process_and_completes(
    tmp_path, mlflow_store, tiny_model_dir, tiny_adapter_dir, fim_samples
):
    """Issue 58, item 3: a registered version is an MLflow pyfunc model (tasks/deploy/mlflow_model.py): MLflow's own
    `mlflow.pyfunc.load_model("models:/NAME@alias")`, in a process of its own, loads the full champion and the
    adapter challenger (on its recorded base) and completes a prompt; the adapter completes as tabrl does."""
    import json
    import os
    import subprocess
    import sys

    from tasks.core.generate import load_model

    params = tiny_params(tmp_path)
    registry, runs = Registry(params), CycleRuns(params)
    base = registry.ensure_champion(tiny_model_dir)
    adapter = registry.register(tiny_adapter_dir, runs.start(), base=base)
    registry.set_alias(CHALLENGER, adapter.version)
    template = load_model(tiny_model_dir).template  # the prompts the adapter was trained to answer otherwise
    prompts = [template.render(s["prefix"][-300:], s["suffix"][:60]) for s in fim_samples[:16]]
    # MLflow's load and tabrl's own, in one process, sampling at T = 1 from the same seed: the same model draws the
    # same tokens, and the adapter draws others than its base (greedy, this near-uniform test model may answer every
    # prompt with its end-of-text token, base and adapter alike, depending on the CPU's float rounding)
    script = (
        "import json, sys, mlflow, torch\n"
        "from tasks.core.generate import generate, load_model\n"
        "prompts, dirs, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}\n"
        "for alias in ('champion', 'challenger'):\n"
        f"    model = mlflow.pyfunc.load_model('models:/{registry.name}@' + alias)\n"
        "    lm = load_model(dirs[alias])\n"
        "    torch.manual_seed(0)\n"
        "    loaded = model.predict(prompts, params={'max_tokens': 32, 'temperature': 1.0})\n"
        "    torch.manual_seed(0)\n"
        "    own = generate(lm.model, lm.tokenizer, lm.template, prompts, 32, temperature=1.0)\n"
        "    out[alias] = (loaded, [g.text for g in own])\n"
        "print(json.dumps(out))\n"
    )
    dirs = {"champion": str(tiny_model_dir), "challenger": str(tiny_adapter_dir)}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(prompts), json.dumps(dirs)],
        env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_store},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for alias, (loaded, expected) in got.items():
        assert loaded == expected, (alias, loaded, expected)
    assert any(got["champion"][0]), "sampling at T = 1 gives some text"
    assert got["champion"][0] != got["challenger"][0], "the adapter answers otherwise than its base"
