"""The cluster on one machine, as separate processes (issue 18): a `prefect server`, two `prefect worker`
processes (pools `cpu` and `gpu`, each in its own empty working directory), an `mlflow server`
(SQLite + artifact root, artifacts over HTTP), the gateway, and a DVC remote in a temp directory.

`tabrl deploy` registers the flows; a cycle run of the deployment trains on the gpu worker and its
candidate goes live as the challenger. Then the gpu worker is killed mid-training together with
the flow run it started (a lost host: nothing reports the run, it stays Running): the cycle
cancels it after cluster.train_timeout_s and ends `train_failed` with the registry, the arms and
the watermark untouched; with a new gpu worker the next cycle trains on the same rows and deploys.
The training data is the same as in tests/test_flow_cycle.py (users who accept everything teach
the tiny model to suggest), so each successful cycle passes the gate.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import sqlalchemy as sa
from mlflow import MlflowClient

from serving.simulate import run_simulation
from tasks.core.procs import free_port, wait_until_up
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, completions, init_schema, read_arms, replace_arms
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.registry import Registry
from tasks.ingest.pull import read_watermark
from tasks.sim.users import make_users
from tests.test_flow_cycle import EVERY_ANSWER_TAKEN, FAST_TRAIN, _dvc_repo, write_cycle_inputs

REPO_ROOT = Path(__file__).resolve().parents[1]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@contextmanager
def _process(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """A child in its own process group, SIGTERM to the group at the end (SIGKILL if it lingers)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


def _worker(pool: str, cwd: Path, env: dict[str, str], log: Path):
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    return _process(cmd, cwd, env, log)


def _process_tree(root: int) -> list[int]:
    """root and every process below it (the flow runs a process worker starts are in sessions of their own)."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _flow_run_processes(flow_run_id: str) -> list[int]:
    """Processes running a flow run: Prefect gives each one PREFECT__FLOW_RUN_ID in its environment (found
    by that, not by parentage: the worker may start a flow run through a process that does not wait for it)."""
    mark = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _api(method: str, url: str, **kw) -> httpx.Response:
    """One Prefect API call. A busy server (its SQLite store locked under load) answers 503 Service Unavailable
    or, now and then, not within the timeout; Prefect's own client retries both: so does this, a second apart,
    a few times (a fresh-clone run once met a 30 s read timeout while a training flow run started). A call that
    creates something is sent again only with an idempotency key (CI once met the timeout on create_flow_run):
    the server then answers the first call's object, not a second one."""
    reads = method == "GET" or url.endswith("/filter") or "idempotency_key" in kw.get("json", {})
    for attempt in range(10):
        try:
            answer = httpx.request(method, url, timeout=30, **kw)
        except httpx.TimeoutException:
            if not reads or attempt == 9:
                raise
            continue
        if answer.status_code != 503:
            break
        time.sleep(1)
    return answer


def _start_cycle(api: str, force: bool = False, more: tuple[str, ...] = ()) -> str:
    """A run of the cycle deployment, as `prefect deployment run` makes one (the schedule's runs are the same);
    `more` overrides are added to the deployment's own."""
    deployment = _api("GET", f"{api}/deployments/name/online-rl-cycle/online-rl-cycle").json()
    overrides = [*deployment["parameters"]["overrides"], *more]
    assert "cluster.train_on=pool" in overrides, deployment["parameters"]
    body = {"parameters": {"force": force, "overrides": overrides}, "idempotency_key": uuid.uuid4().hex}
    made = _api("POST", f"{api}/deployments/{deployment['id']}/create_flow_run", json=body)
    assert made.status_code in (200, 201), made.text  # 200: a retried call's run, made by the first
    return made.json()["id"]


def _flow_runs(api: str, flow_name: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "sort": "START_TIME_DESC"}
    return _api("POST", f"{api}/flow_runs/filter", json=body).json()


def _wait_for(what: str, check, timeout_s: float, logs: list[Path]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.is_file())
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{tails}")


def _state(api: str, flow_run_id: str) -> str:
    return _api("GET", f"{api}/flow_runs/{flow_run_id}").json()["state"]["type"]


def _last_cycle_run(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs(
        [exp.experiment_id], "tags.`tabrl.kind` = 'cycle'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0]


def test_cycle_trains_on_the_gpu_worker_and_survives_losing_it(
    tmp_path, tiny_model_dir, fim_samples, typing_regions, _mlflow_template
):
    repo = _dvc_repo(tmp_path / "repo")
    dvc_remote = tmp_path / "dvc-remote"
    for cmd in (["remote", "add", "-d", "store", str(dvc_remote)],):
        subprocess.run([sys.executable, "-m", "dvc", *cmd], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qam", "dvc remote"], cwd=repo, check=True)
    prefect_port, mlflow_port, gateway_port = free_port(), free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    tracking = f"http://127.0.0.1:{mlflow_port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "COLUMNS", "LINES"):
        env.pop(name, None)
    sections = {
        "simulator": EVERY_ANSWER_TAKEN,
        "serving": {"auth": False, "temperature": 1.0, "max_tokens": 1, "port": gateway_port, "config_ttl_s": 0.5},
        "ingest": {"feedback_timeout_s": 0.5},
        "train": FAST_TRAIN,
        "reward": {"advantage": "raw"},
        "evaluate": {"n_samples": 16, "n_requests": 32, "max_new_tokens": 1, "gate_tolerance": 1.0},
        "deploy": {"challenger_share": 0.3, "cycle_every_minutes": 600},
        "cluster": {"train_timeout_s": 240, "train_poll_s": 1, "dvc_remote": "store"},
        "paths": {"mlflow_tracking_uri": tracking},
    }
    params, params_file = write_cycle_inputs(tmp_path, repo, fim_samples, typing_regions, **sections)
    registry = Registry(params)
    logs = {name: tmp_path / f"{name}.log" for name in ("prefect", "mlflow", "gateway", "cpu", "gpu", "gpu2")}
    mlflow_dir = tmp_path / "mlflow"
    mlflow_dir.mkdir()
    shutil.copy(_mlflow_template, mlflow_dir / "mlflow.db")  # an already migrated store: starts in seconds

    with ExitStack() as stack:
        prefect_server = stack.enter_context(
            _process(
                [
                    sys.executable,
                    "-m",
                    "prefect",
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(prefect_port),
                ],
                tmp_path,
                env,
                logs["prefect"],
            )
        )
        mlflow_server = stack.enter_context(
            _process(
                [
                    *(sys.executable, "-m", "mlflow", "server", "--workers", "1"),
                    *("--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}"),
                    *("--artifacts-destination", str(mlflow_dir / "artifacts")),
                    *("--host", "127.0.0.1", "--port", str(mlflow_port)),
                ],
                mlflow_dir,
                env,
                logs["mlflow"],
            )
        )
        wait_until_up(f"{tracking}/health", mlflow_server, 120)
        champion = registry.ensure_champion(tiny_model_dir)  # uploaded to the server: no path is shared
        engine = Store(params.paths.database_url).engine
        init_schema(engine)
        champion_dir = resolve_model_dir(champion.uri, params)  # downloaded into the cycle side's state dir
        replace_arms(engine, [Arm(CHAMPION, champion.label, str(champion_dir), "embedded", 1.0)])
        gateway = stack.enter_context(
            _process(
                [sys.executable, "-m", "flows.cli", "serve", "--no-auth", "--params", str(params_file)],
                tmp_path,
                env,
                logs["gateway"],
            )
        )
        url = f"http://127.0.0.1:{gateway_port}"
        wait_until_up(f"{api}/health", prefect_server, 120)
        deployed = subprocess.run(
            [sys.executable, "-m", "flows.cli", "deploy", "--params", str(params_file), "--repo", str(repo)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "train-candidate/train-candidate on pool gpu" in deployed.stdout, deployed.stdout
        stack.enter_context(_worker("cpu", tmp_path / "cpu-host", env, logs["cpu"]))
        gpu = stack.enter_context(_worker("gpu", tmp_path / "gpu-host", env, logs["gpu"]))
        wait_until_up(f"{url}/healthz", gateway, 120)

        def traffic(seed: int) -> None:
            run_simulation(
                url,
                typing_regions[:: 1 if seed == 0 else -1],
                make_users(4, params.simulator),
                48,
                api_keys=None,
                concurrency=4,
                seed=seed,
                traffic=params.traffic,
                simulator=params.simulator,
            )
            time.sleep(params.ingest.feedback_timeout_s + 0.2)

        traffic(0)
        client = MlflowClient(tracking_uri=tracking)
        everything = list(logs.values())

        # 1. A cycle run of the deployment on the cpu pool; training on the gpu worker.
        first = _start_cycle(api)
        _wait_for("cycle 1", lambda: _state(api, first) in FINAL, 400, everything)
        assert _state(api, first) == "COMPLETED", logs["cpu"].read_text()[-3000:]
        run1 = _last_cycle_run(client, params.deploy.experiment)
        assert run1.data.tags["tabrl.cycle_status"] == "deployed", run1.data.tags.get("tabrl.cycle_reason")
        train_runs = _flow_runs(api, "train-candidate")
        assert [(r["work_pool_name"], r["state"]["type"]) for r in train_runs] == [("gpu", "COMPLETED")]
        assert _api("GET", f"{api}/flow_runs/{first}").json()["work_pool_name"] == "cpu"
        assert "train/loss" in run1.data.metrics and run1.data.tags["tabrl.train_outcome"] == "trained"
        artifacts = {a.path for a in client.list_artifacts(run1.info.run_id)}
        assert {"snapshot", "model"} <= artifacts, artifacts
        sent = train_runs[0]["parameters"]  # references only: the gpu side shares no path with the cycle
        assert sent["from_uri"] == champion.uri and sent["snapshot_uri"].startswith(f"runs:/{run1.info.run_id}/")
        assert [p for p in dvc_remote.rglob("*") if p.is_file()], "the snapshot was pushed to the DVC remote"
        version = registry.aliased(CHALLENGER)
        assert version is not None and version.version == champion.version + 1 and version.run_id == run1.info.run_id
        assert {a.name: a.model_version for a in read_arms(engine)} == {
            CHAMPION: champion.label,
            CHALLENGER: version.label,
        }
        with engine.connect() as conn:
            watermark1 = read_watermark(conn).completion_seq

        # The gateway serves the new version: the next traffic reaches the challenger arm.
        traffic(1)
        with engine.connect() as conn:
            served = conn.execute(
                sa.select(sa.func.count()).where(
                    completions.c.arm == CHALLENGER, completions.c.model_version == version.label
                )
            ).scalar_one()
        assert served > 0

        # 2. Kill the gpu worker mid-training: the run it held stays Running until the cycle gives up on it.
        slow = ("train.epochs=4000", "train.lr=1e-4", "cluster.train_timeout_s=90")  # outlasts 90 s
        second = _start_cycle(api, force=True, more=slow)

        def training_processes() -> list[int]:
            """The processes of the train-candidate flow run now Running (none while it is not)."""
            running = [r for r in _flow_runs(api, "train-candidate") if r["state"]["type"] == "RUNNING"]
            return _flow_run_processes(running[0]["id"]) if running else []

        _wait_for(
            "training to start on the gpu worker",
            lambda: (
                _state(api, second) not in FINAL
                and "train/loss" in _last_cycle_run(client, params.deploy.experiment).data.metrics
                and _last_cycle_run(client, params.deploy.experiment).info.run_id != run1.info.run_id
                and bool(training_processes())
            ),
            240,
            everything,
        )
        # The GPU host is lost: the worker and the flow run it started die at once, so nobody reports the run
        # (a worker killed alone lets its flow run mark itself Crashed; this is the case only a timeout ends).
        # The flow run's process is found by its PREFECT__FLOW_RUN_ID, not as a child of the worker.
        training = training_processes()
        assert training, "the training flow run's process is found"
        doomed = set(_process_tree(gpu.pid)) | set(training)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):  # a helper process that ended on its own
                os.kill(pid, signal.SIGKILL)
        gpu.wait(10)
        _wait_for("cycle 2", lambda: _state(api, second) in FINAL, 240, everything)
        assert _state(api, second) == "COMPLETED"
        run2 = _last_cycle_run(client, params.deploy.experiment)
        assert run2.data.tags["tabrl.cycle_status"] == "train_failed", run2.data.tags
        assert "did not finish within cluster.train_timeout_s=90" in run2.data.tags["tabrl.cycle_reason"]
        assert _flow_runs(api, "train-candidate")[0]["state"]["type"] == "CANCELLED"
        assert registry.aliased(CHALLENGER).version == version.version  # nothing half-registered
        assert len(client.search_model_versions(f"name = '{params.deploy.registered_model}'")) == 2
        assert {a.name: a.model_version for a in read_arms(engine)}[CHALLENGER] == version.label
        with engine.connect() as conn:
            assert read_watermark(conn).completion_seq == watermark1  # the rows wait for the next cycle

        # 3. A worker is back: the next cycle trains on the same snapshot and deploys.
        stack.enter_context(_worker("gpu", tmp_path / "gpu-host-2", env, logs["gpu2"]))
        third = _start_cycle(api, force=True)
        _wait_for("cycle 3", lambda: _state(api, third) in FINAL, 400, everything)
        run3 = _last_cycle_run(client, params.deploy.experiment)
        assert run3.data.tags["tabrl.cycle_status"] == "deployed", run3.data.tags.get("tabrl.cycle_reason")
        assert run3.data.tags["tabrl.snapshot_sha256"] == run2.data.tags["tabrl.snapshot_sha256"]
        assert registry.aliased(CHALLENGER).version == version.version + 1
        with engine.connect() as conn:
            assert read_watermark(conn).completion_seq > watermark1
        engine.dispose()
        # the runner before the server, or it hangs (STACK-NOTES): ExitStack stops them in reverse order
