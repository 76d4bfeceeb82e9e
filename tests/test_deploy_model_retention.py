"""Model retention (tasks/deploy/model_retention.py): a temp MLflow store, a temp log store and real directories."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml
from typer.testing import CliRunner

from tasks.core.adapters import ADAPTER_CONFIG, BASE_FILE, write_base
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, init_schema, replace_arms
from tasks.deploy.model_cache import candidate_dir, model_cache_dir, resolve_model_dir
from tasks.deploy.model_retention import delete_retired, plan_model_retention
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import CycleRuns, tracking_client
from tests.conftest import tiny_params

OLD_H = 48.0  # hours since an "old" copy was written; the tests' retention is 24 h


def _checkpoint(path: Path) -> Path:
    """A small directory shaped like a Hugging Face checkpoint."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 1000)
    return path


def _age(path: Path, hours: float) -> None:
    """Make path and everything in it last written `hours` ago."""
    then = time.time() - hours * 3600
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (then, then))
    os.utime(path, (then, then))


def _registered(params, checkpoint: Path, base=None):
    """checkpoint (an adapter on version `base`) registered as a new version by a finished cycle run;
    (version, run id)."""
    run_id = CycleRuns(params).start()
    version = Registry(params).register(checkpoint, run_id, base=base)
    CycleRuns(params).end(run_id)
    return version, run_id


def _setup(tmp_path, retention_h: float = 24.0):
    """A registry, a log store with three arms and the two folders filled with every kind of copy, all old
    but the young candidate. Returns (params, engine, paths by role)."""
    candidates = tmp_path / "models" / "candidates"
    base = candidates / "base-model"  # configured inside a folder retention cleans: still never deleted
    params = tiny_params(tmp_path, deploy={"retired_retention_hours": retention_h}, model={"base_dir": str(base)})
    _checkpoint(base)
    champion = Registry(params).ensure_champion(base)  # version 1, alias champion
    lora_base, _ = _registered(params, _checkpoint(tmp_path / "trained" / "v2"))  # no alias: live as a base
    retired, retired_run = _registered(params, _checkpoint(tmp_path / "trained" / "v3"))  # no alias, no arm
    lora = tmp_path / "trained" / "v4"
    lora.mkdir()
    (lora / ADAPTER_CONFIG).write_text('{"r": 8}')
    write_base(lora, resolve_model_dir(lora_base.uri, params))
    challenger, _ = _registered(params, lora, base=lora_base)  # an adapter version on version 2
    Registry(params).set_alias(CHALLENGER, challenger.version)
    running_run = CycleRuns(params).start()  # a cycle still training or evaluating its candidate

    client = tracking_client(params)  # an MLflow artifact location someone put inside the model cache
    experiment = client.create_experiment("elsewhere", artifact_location=(model_cache_dir(params) / "art").as_uri())
    other_run = client.create_run(experiment).info.run_id
    client.log_artifacts(other_run, str(_checkpoint(tmp_path / "trained" / "other")), "model")

    adapter = candidate_dir(params, "adapter-served")
    adapter.mkdir(parents=True)
    (adapter / ADAPTER_CONFIG).write_text('{"r": 8}')
    adapter_base = _checkpoint(candidate_dir(params, "adapter-base"))
    (adapter / BASE_FILE).write_text(json.dumps({"sha256": "0" * 64, "path": str(adapter_base)}))
    paths = {
        "base": base,
        "served": _checkpoint(candidate_dir(params, "served")),
        "adapter": adapter,
        "adapter_base": adapter_base,
        "young": _checkpoint(candidate_dir(params, "young")),
        "running": _checkpoint(candidate_dir(params, running_run)),
        "old_candidate": _checkpoint(candidate_dir(params, retired_run)),
        "champion_download": resolve_model_dir(champion.uri, params, copy=True),
        "retired_download": resolve_model_dir(retired.uri, params, copy=True),
        "challenger_base_download": resolve_model_dir(lora_base.uri, params, copy=True),
        "run_download": resolve_model_dir(f"runs:/{retired_run}/model", params).parent,
        "artifact_location": model_cache_dir(params) / "art" / other_run,
        "outside_models": _checkpoint(tmp_path / "models" / "elsewhere"),
        "outside_state": _checkpoint(tmp_path / "state" / "elsewhere"),
    }
    assert paths["champion_download"] == model_cache_dir(params) / params.deploy.registered_model / "1"
    for role, path in paths.items():
        if role != "young":
            _age(path, OLD_H)
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(
        engine,
        [
            Arm(CHAMPION, champion.label, str(paths["served"]), "embedded", 0.5),
            Arm(CHALLENGER, challenger.label, str(base), "embedded", 0.3, adapter=str(adapter)),
            Arm("canary", "x/9", "http://127.0.0.1:9/v1", "vllm", 0.2),  # a URL: no directory of this host
        ],
    )
    return params, engine, paths


def test_retired_old_copies_go_and_live_young_base_and_outside_ones_stay(tmp_path, mlflow_store):
    params, engine, paths = _setup(tmp_path)
    plan = plan_model_retention(engine, params)
    verdicts = {c.path: c for c in plan}
    retired = {c.path for c in plan if c.retired}
    assert retired == {paths["old_candidate"], paths["retired_download"], paths["run_download"]}
    why = {role: verdicts[p].why for role, p in paths.items() if p in verdicts}
    assert why["served"].startswith("arm 'champion' serves it")
    assert why["adapter"].startswith("arm 'challenger' serves it as its adapter")
    assert why["adapter_base"].startswith("the base of a live adapter")
    assert why["champion_download"] == "alias 'champion' names tabrl-completion/1"
    assert why["challenger_base_download"] == "the base of tabrl-completion/4, which alias 'challenger' names"
    assert why["young"].startswith("written 0.0 h ago, under deploy.retired_retention_hours=24")
    assert why["running"] == f"cycle run {paths['running'].name} is still running"
    assert why["base"] == "model.base_dir (the base model)"
    assert why["artifact_location"] == "MLflow artifact location of experiment 'elsewhere'"
    assert why["old_candidate"].startswith("no arm serves it and no alias names it")
    assert "outside_models" not in why and "outside_state" not in why  # never even looked at
    old = verdicts[paths["retired_download"]]
    assert old.age_hours > OLD_H - 0.1 and old.size_bytes >= 1000 and old.what == "download of tabrl-completion/3"

    deleted = delete_retired(plan)
    assert {c.path for c in deleted} == retired
    assert not any(p.exists() for p in retired)
    assert all(p.exists() for role, p in paths.items() if p not in retired), "a kept copy was deleted"
    assert all(p.parent.is_dir() for p in retired)  # the folders themselves stay
    engine.dispose()


def test_retention_zero_deletes_a_retired_copy_at_once(tmp_path, mlflow_store):
    params, engine, paths = _setup(tmp_path, retention_h=0.0)
    retired = {c.path for c in delete_retired(plan_model_retention(engine, params))}
    assert retired == {paths["young"], paths["old_candidate"], paths["retired_download"], paths["run_download"]}
    assert paths["served"].exists() and paths["running"].exists() and paths["base"].exists()
    engine.dispose()


def test_cli_dry_run_lists_and_deletes_nothing_then_deletes(tmp_path, mlflow_store):
    from flows.cli.main import app

    params, engine, paths = _setup(tmp_path)
    engine.dispose()
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    runner = CliRunner()
    result = runner.invoke(app, ["model-retention", "--dry-run", "--params", str(params_file)])
    assert result.exit_code == 0, result.output
    assert "would delete 3 of 12 local copies" in result.output and "still running" in result.output
    assert all(p.exists() for p in paths.values())
    result = runner.invoke(app, ["model-retention", "--params", str(params_file)])
    assert result.exit_code == 0 and "deleted 3 of 12 local copies" in result.output, result.output
    assert not paths["old_candidate"].exists() and paths["served"].exists()
    result = runner.invoke(app, ["model-retention", "--params", str(params_file)])
    assert "deleted 0 of 9 local copies" in result.output
