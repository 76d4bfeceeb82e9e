"""Faults, each a test: a backend process killed, the gateway SIGKILLed, the log store unavailable,
a training job killed, the judge down, MLflow down during a rollout. Nothing acknowledged is lost,
and nothing passes on no evidence."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
import sqlalchemy as sa
from prefect import flow

import tasks.deploy.rollout as rollout_mod
from serving.auth import add_key
from serving.gateway import create_app
from serving.router import assign
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, completions, init_schema, read_arms, replace_arms
from tasks.deploy.errors import DeployError
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import CycleRuns
from tasks.evaluate.evaluate import compare
from tasks.evaluate.judge import JudgeUnavailable
from tasks.train.policy import RESULT_FILE
from tests.conftest import tiny_params
from tests.harden_util import start_backend
from tests.serving_util import serve_app
from tests.support.harness import (
    ROOT,
    drive_editors,
    editor_prompt,
    fast_backend_factory,
    free_port,
    make_keys,
    seed_arms,
    start_process,
    stop_process,
    store_problems,
)
from tests.test_train_job import snapshot  # noqa: F401  (fixture)

FAST = Arm(CHAMPION, "fast/1", "fast", "embedded", 1.0)


def _count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar()


def _kill_after(n_answers: int, kill, arm: str | None = None):
    """An on_progress callback that calls kill() once, when n_answers completion answers have come back
    (from `arm` only, when given)."""
    done = []

    def progress(result):
        seen = result.acked_arms[arm] if arm else sum(result.statuses.values())
        if not done and seen >= n_answers:
            done.append(True)
            kill()

    return progress


# ------------------------------------------------------------------------------------------ serving


def test_backend_killed_mid_load_fails_over_to_the_champion_then_502(tmp_path, tiny_model_dir):
    port = free_port()
    backend = start_backend(port, str(tiny_model_dir))
    try:
        url_b = f"http://127.0.0.1:{port}"
        assert (
            httpx.post(
                f"{url_b}/v1/completions", json={"prompt": editor_prompt(0), "max_tokens": 4}, timeout=60
            ).status_code
            == 200
        )  # the model is loaded before the load starts
        params = tiny_params(tmp_path, serving={"config_ttl_s": 0, "backend_timeout_s": 10})
        engine = Store(params.paths.database_url).engine
        init_schema(engine)
        arms = [Arm(CHAMPION, "fast/1", "fast", "embedded", 0.5), Arm(CHALLENGER, "tiny/2", url_b, "vllm", 0.5)]
        replace_arms(engine, arms)
        app = create_app(params, engine=engine, auth=False, backend_factory=fast_backend_factory)
        # Only users the challenger serves: champion users answered at once would use up the requests before
        # the challenger's slow model had answered 4 of them (and the kill would come after the load).
        salt = params.serving.experiment_salt
        editors = [(u, None) for u in (f"u{i}" for i in range(40)) if assign(u, salt, arms).name == CHALLENGER][:6]
        with serve_app(app) as url:
            result = asyncio.run(drive_editors(url, editors, 80, on_progress=_kill_after(4, backend.kill, CHALLENGER)))
            assert backend.wait(5) == -signal.SIGKILL
            assert result.statuses[200] >= 80 and result.errors == 0, result.statuses  # every request answered
            assert result.acked_arms[CHALLENGER] > 0 and result.acked_arms[CHAMPION] > 0
            fallbacks = httpx.get(f"{url}/metrics").text
            assert f'tabrl_fallbacks_total{{arm="{CHALLENGER}",team="org"}}' in fallbacks
            assert store_problems(engine, result, {CHAMPION, CHALLENGER}) == []
            assert _count(engine) == len(result.acked)
            # The champion's own backend dies: 502 naming the arm, nothing stored.
            replace_arms(engine, [Arm(CHAMPION, "tiny/2", url_b, "vllm", 1.0)])
            r = httpx.post(f"{url}/v1/completions", json={"prompt": editor_prompt(1), "user": "u0"}, timeout=30)
            assert r.status_code == 502 and "'champion'" in r.json()["error"]["message"]
            assert _count(engine) == len(result.acked)
        engine.dispose()
    finally:
        stop_process(backend)


def test_gateway_sigkilled_mid_load_loses_no_acknowledged_row(store_url):  # noqa: F811
    seed_arms(store_url, [FAST])
    editors = make_keys(store_url, 8)
    port = free_port()
    gateway = start_process("gateway", port, "--db", store_url)
    try:
        url = f"http://127.0.0.1:{port}"
        result = asyncio.run(
            drive_editors(
                url,
                editors,
                300,
                timeout_s=5,
                pause_on_error_s=0.01,
                on_progress=_kill_after(60, lambda: os.kill(gateway.pid, signal.SIGKILL)),
            )
        )
        assert gateway.wait(5) == -signal.SIGKILL
        assert result.statuses["conn"] > 0 and len(result.acked) >= 20, result.statuses
        gateway = start_process("gateway", port, "--db", store_url)  # restart on the same store
        engine = Store(store_url).engine
        assert store_problems(engine, result, {CHAMPION}) == []  # every acknowledged row survived
        stored = _count(engine)
        assert stored >= len(result.acked)  # (a row committed whose answer the kill cut off may be extra)
        r = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {editors[0][1]}"},
            json={"prompt": editor_prompt(0)},
        )
        assert r.status_code == 200 and _count(engine) == stored + 1
        engine.dispose()
    finally:
        stop_process(gateway)


def test_sqlite_locked_answers_503_with_retry_after_and_recovers(tmp_path):
    """Real: another process's connection holds the SQLite write lock (BEGIN EXCLUSIVE) for 3 s, as a
    long migration, backup or `sqlite3` shell would; writes time out after serving.db_timeout_s."""
    params = tiny_params(tmp_path, serving={"db_timeout_s": 0.5, "config_ttl_s": 60})
    engine = Store(params.paths.database_url, timeout_s=params.serving.db_timeout_s).engine
    init_schema(engine)
    replace_arms(engine, [FAST])
    key = add_key(engine, "alice")
    app = create_app(params, engine=engine, auth=True, backend_factory=fast_backend_factory)
    headers = {"Authorization": f"Bearer {key}"}
    with serve_app(app) as url, httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        ok = client.post("/v1/completions", json={"prompt": editor_prompt(0)})
        assert ok.status_code == 200  # key, arms and opt-out now cached
        locker = sqlite3.connect(str(tmp_path / "tabrl.db"), timeout=5)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            busy = [client.post("/v1/completions", json={"prompt": editor_prompt(i)}) for i in range(3)]
            fb = client.post("/v1/feedback", json={"completion_id": ok.json()["id"], "accepted": True})
        finally:
            locker.rollback()
            locker.close()
        for r in [*busy, fb]:
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "2" and "log store is unavailable" in r.json()["error"]["message"]
        after = [client.post("/v1/completions", json={"prompt": editor_prompt(i)}) for i in range(3)]
        assert [r.status_code for r in after] == [200] * 3  # recovered, same process
        assert client.post("/v1/feedback", json={"completion_id": ok.json()["id"], "accepted": True}).status_code == 200
    with engine.connect() as conn:
        ids = set(conn.execute(sa.select(completions.c.id)).scalars())
    assert ids == {ok.json()["id"], *(r.json()["id"] for r in after)}  # the 503s stored nothing
    engine.dispose()


def test_postgres_connections_terminated_answer_503_and_recover(tmp_path):
    """Real: the server terminates the gateway's connections (pg_terminate_backend, as a failover,
    restart or an admin would) again and again for 3 s, mid-load."""
    base = os.environ.get("TABRL_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("PostgreSQL fault skipped: set TABRL_TEST_POSTGRES_URL to run it")
    schema = f"t_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = f"{base}?options=-csearch_path%3D{schema}&application_name={schema}"
    try:
        params = tiny_params(tmp_path, paths={"database_url": url}, serving={"db_timeout_s": 2, "config_ttl_s": 0})
        engine = Store(url, timeout_s=2).engine
        init_schema(engine)
        replace_arms(engine, [FAST])
        app = create_app(params, engine=engine, auth=False, backend_factory=fast_backend_factory)
        stop = threading.Event()
        killed = []

        def terminator():
            deadline = time.monotonic() + 3
            with admin.connect() as conn:
                while time.monotonic() < deadline and not stop.is_set():
                    killed.extend(
                        conn.execute(
                            sa.text(
                                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :a"
                            ),
                            {"a": schema},
                        ).scalars()
                    )
                    time.sleep(0.05)

        with serve_app(app) as gw:
            thread = threading.Thread(target=terminator)
            result_holder = {}

            def start_killing(result):
                if not thread.is_alive() and not killed and sum(result.statuses.values()) >= 20:
                    thread.start()

            result = asyncio.run(
                drive_editors(gw, [(f"u{i}", None) for i in range(6)], 240, timeout_s=10, on_progress=start_killing)
            )
            stop.set()
            thread.join()
            result_holder["r"] = result
            assert killed, "no connection was terminated"
            assert set(result.statuses) <= {200, 503}, result.statuses  # never a 500
            after = httpx.post(f"{gw}/v1/completions", json={"prompt": editor_prompt(0), "user": "u0"}, timeout=10)
            assert after.status_code == 200  # recovered, same process
        assert store_problems(engine, result, {CHAMPION}) == []
        engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


# ------------------------------------------------------------------------------------------ pipeline


def test_training_job_killed_mid_run_leaves_no_checkpoint_and_reruns(tmp_path, tiny_model_dir, snapshot):  # noqa: F811
    """torchrun with two gloo ranks, killed (SIGKILL to the whole process group) once the ranks train."""
    out = tmp_path / "candidate"
    script = (
        "import sys; from pathlib import Path; from tests.conftest import tiny_params; "
        "from tasks.train.launch import launch_train; "
        "p = tiny_params(Path(sys.argv[1]), train={'nproc': 2, 'micro_batch': 4, 'epochs': 200, 'lr': 1e-4}); "
        "launch_train(sys.argv[2], sys.argv[3], sys.argv[4], p)"
    )
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path), str(snapshot), str(tiny_model_dir), str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    deadline = time.monotonic() + 120
    for line in job.stdout:  # the launcher echoes the ranks' output; the progress bar shows training started
        seen.append(line)
        if "step" in line.lower() or "it/s" in line or "s/it" in line or time.monotonic() > deadline:
            break
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(10)
    assert job.returncode == -signal.SIGKILL, "".join(seen[-20:])
    assert not out.exists()  # no checkpoint at --out: nothing for the cycle to register
    Path(f"{out.parent}/.{out.name}.tmp").mkdir(exist_ok=True)  # as if killed while saving, too
    from tasks.train.launch import launch_train

    params = tiny_params(tmp_path, train={"nproc": 1, "micro_batch": 4, "epochs": 1, "lr": 1e-4})
    result = launch_train(snapshot, tiny_model_dir, out, params)  # the cycle's retry (in-process: quicker here)
    assert (out / RESULT_FILE).is_file() and (out / "config.json").is_file() and result.steps >= 1


@pytest.fixture
def dead_url():
    return f"http://127.0.0.1:{free_port()}/v1"  # bound once, closed: connection refused


def test_judge_down_fails_the_evaluation_loudly(
    tmp_path, babbler_dir, fim_samples, typing_regions, dead_url, monkeypatch
):
    monkeypatch.setenv("TABRL_JUDGE_API_KEY", "sk-test")
    judge = {
        "kind": "llm",
        "base_url": dead_url,
        "max_retries": 0,
        "timeout_s": 2,
        "cache_path": str(tmp_path / "judge.sqlite"),
        "on_failure": "fail",
    }
    params = tiny_params(tmp_path, evaluate={"n_samples": 4, "max_new_tokens": 6, "judge": judge})
    with pytest.raises(JudgeUnavailable, match="unavailable"):
        compare(babbler_dir, babbler_dir, fim_samples, typing_regions, params)


def test_judge_down_falls_back_to_the_reference_judge_and_never_passes_on_no_evidence(
    tmp_path, babbler_dir, fim_samples, typing_regions, dead_url, monkeypatch
):
    monkeypatch.setenv("TABRL_JUDGE_API_KEY", "sk-test")
    judge = {
        "kind": "llm",
        "base_url": dead_url,
        "max_retries": 0,
        "timeout_s": 2,
        "cache_path": str(tmp_path / "judge.sqlite"),
        "on_failure": "reference",
    }
    params = tiny_params(tmp_path, evaluate={"n_samples": 4, "max_new_tokens": 6, "judge": judge})
    done = compare(babbler_dir, babbler_dir, fim_samples, typing_regions, params)
    assert done.candidate.judge.startswith("reference (fallback: ") and done.champion.judge == done.candidate.judge
    assert done.candidate.metrics["eval/judge_scored"] > 0  # the reference judge scored what the LLM judge could not
    assert not done.decision.passed  # the same model is never "better", whichever judge scored it
    # No evidence at all (every completion empty: nothing judged) never passes, however the numbers look.
    from tasks.evaluate.gate import gate

    empty = {
        k: 0.0
        for k in ("eval/typing/reward_per_request", "eval/judge_mean", "eval/judge_scored", "eval/typing/chars_saved")
    }
    better = {**empty, "eval/typing/reward_per_request": 0.5, "eval/judge_mean": 9.0, "eval/typing/chars_saved": 0.5}
    assert not gate(better, empty, params.evaluate).passed


# ------------------------------------------------------------------------------------------ deploy


@flow
def _rollout_flow(version, model_dir, params):
    return rollout_mod.rollout(version, model_dir, params)


def _deploy_setup(tmp_path, tiny_model_dir):
    params = tiny_params(tmp_path)
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm(CHAMPION, "tabrl-completion/1", str(tiny_model_dir), "embedded", 1.0)])
    Registry(params).ensure_champion(tiny_model_dir)
    return params, engine


def _down(params, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    return params.model_copy(
        update={"paths": params.paths.model_copy(update={"mlflow_tracking_uri": f"http://127.0.0.1:{free_port()}"})}
    )


def test_mlflow_down_before_rollout_leaves_arms_unchanged(
    tmp_path, mlflow_store, tiny_model_dir, prefect_harness, monkeypatch
):
    params, engine = _deploy_setup(tmp_path, tiny_model_dir)
    registry = Registry(params)
    version = registry.register(tiny_model_dir, CycleRuns(params).start())
    before = read_arms(engine)
    with pytest.raises(Exception) as err:
        _rollout_flow(version, str(tiny_model_dir), _down(params, monkeypatch))
    assert "127.0.0.1" in str(err.value) or "Connection" in repr(err.value)
    assert read_arms(engine) == before
    assert registry.aliased(CHALLENGER) is None


def test_mlflow_down_mid_rollout_restores_the_arms(
    tmp_path, mlflow_store, tiny_model_dir, prefect_harness, monkeypatch
):
    """MLflow goes away after the alias was set and the arms swapped; the last step fails. The arms
    are restored even though the alias rollback cannot reach MLflow."""
    params, engine = _deploy_setup(tmp_path, tiny_model_dir)
    version = Registry(params).register(tiny_model_dir, CycleRuns(params).start())
    before = read_arms(engine)
    down = _down(params, monkeypatch)

    @rollout_mod.task(name="check-arms")
    def mlflow_goes_down(expected, p, team):
        import mlflow

        mlflow.set_tracking_uri(down.paths.mlflow_tracking_uri)
        monkeypatch.setattr(
            rollout_mod.Registry,
            "set_alias",
            lambda *a, **k: (_ for _ in ()).throw(DeployError("MLflow at http://127.0.0.1 unreachable")),
        )
        raise DeployError("injected: MLflow went down during the rollout")

    monkeypatch.setattr(rollout_mod, "check_arms", mlflow_goes_down)
    with pytest.raises(DeployError, match="injected"):
        _rollout_flow(version, str(tiny_model_dir), params)
    assert read_arms(engine) == before
