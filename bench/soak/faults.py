"""The soak's faults on a timer, each followed by its recovery time, and the samples of the stack's arms,
processes, memory and disk."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import sqlalchemy as sa

from bench.soak.stack import Soak, start_redis
from bench.soak.traffic import Ledger, probe_ok
from tasks.core.procs import NotUp, wait_until_up
from tasks.core.store import CHALLENGER, CHAMPION, completions, read_arms

FAULTS = ("gateway", "worker", "mlflow", "postgres", "redis")
MLFLOW_DOWN_S = 60.0
RECOVERY_TIMEOUT_S = 300.0
SAMPLE_S = 15.0  # arms, processes, memory and disk sampled this often


def _program_pid(soak: Soak, name: str) -> int:
    return int(soak.rpc().getProcessInfo(name)["pid"])


def _running_again(soak: Soak, name: str, old_pid: int) -> bool:
    """supervisord runs the program again: a new process, up for its startsecs (RUNNING), not just forked."""
    info = soak.rpc().getProcessInfo(name)
    return info["statename"] == "RUNNING" and int(info["pid"]) not in (0, old_pid)


def _wait(check, timeout_s: float = RECOVERY_TIMEOUT_S) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(0.5)
    return None


def _running_training(soak: Soak) -> str | None:
    flt = {
        "flows": {"name": {"any_": ["train-candidate"]}},
        "flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}},
    }
    runs = httpx.post(f"{soak.prefect_api}/flow_runs/filter", json=flt, timeout=10).json()
    return runs[0]["id"] if runs else None


def _flow_run_processes(run_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("PREFECT__FLOW_RUN_ID") == run_id:
                found.append(proc)
    return found


def _gateway(soak: Soak, ledger: Ledger, nth: int) -> None:
    """kill -9 one of the two gateway processes (the other answers meanwhile), or, every second time, the whole
    gateway: its supervisor process and both workers (supervisord starts it again)."""
    master = psutil.Process(_program_pid(soak, "gateway"))
    at = time.time()
    if nth % 2 == 0:
        victim = sorted(master.children(recursive=True), key=lambda p: p.pid)[-1]
        victim.kill()
        what = f"kill -9 one gateway process ({victim.pid})"
    else:
        os.killpg(master.pid, signal.SIGKILL)
        what = f"kill -9 the whole gateway ({master.pid} and its workers)"
    soak.event("fault", fault="gateway", what=what, recovery_s=_wait(lambda: probe_ok(soak, ledger)), at=at)


def _mlflow(soak: Soak) -> None:
    at = time.time()
    soak.rpc().stopProcess("mlflow", True)
    time.sleep(MLFLOW_DOWN_S)
    soak.rpc().startProcess("mlflow", False)
    started = time.monotonic()
    try:
        wait_until_up(f"{soak.mlflow}/health", None, RECOVERY_TIMEOUT_S)
        back: float | None = time.monotonic() - started
    except NotUp:
        back = None
    soak.event("fault", fault="mlflow", what=f"MLflow server down for {MLFLOW_DOWN_S:.0f} s", recovery_s=back, at=at)


def _restart(soak: Soak, ledger: Ledger, kind: str) -> None:
    """Restart PostgreSQL or Redis; recovery: from the restart until a completion is served again."""
    started, at = time.monotonic(), time.time()
    if kind == "postgres":
        subprocess.run(soak.pg_restart, check=True, capture_output=True, timeout=120)
        what = " ".join(soak.pg_restart)
    else:
        soak.redis.kill()
        soak.redis.wait()
        soak.redis = start_redis(soak.redis_port, soak.out / "redis.log")
        what = "redis-server killed and started again (empty)"
    back = _wait(lambda: probe_ok(soak, ledger))
    soak.event("fault", fault=kind, what=what, recovery_s=None if back is None else time.monotonic() - started, at=at)


def _worker(soak: Soak, nth: int, until: float) -> None:
    """kill -9 the gpu pool's worker and the training flow run it started, at some point of a training (waiting
    for one until `until`); recovery: until supervisord runs the worker again."""
    run_id = None
    while time.time() < until and run_id is None:
        run_id = _running_training(soak)
        if run_id is None:
            time.sleep(2.0)
    if run_id is None:
        soak.event(
            "fault", fault="worker", what="not injected: no training ran in time", recovery_s=None, injected=False
        )
        return
    time.sleep(random.Random(f"worker{nth}").uniform(1.0, 10.0))
    worker, at = _program_pid(soak, "worker-gpu"), time.time()
    for proc in [psutil.Process(worker), *_flow_run_processes(run_id)]:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    back = _wait(lambda: _running_again(soak, "worker-gpu", worker))
    what = f"kill -9 the gpu worker ({worker}) and its training run {run_id}"
    soak.event("fault", fault="worker", what=what, recovery_s=back, flow_run=run_id, at=at)


def fault_plan(seconds: float, rounds: int, seed: int) -> list[tuple[float, str]]:
    """(seconds into the run, fault) for every fault, evenly spread over the run's middle, jittered."""
    rng = random.Random(f"faults:{seed}")
    kinds = [k for _ in range(rounds) for k in FAULTS]
    slot = seconds * 0.85 / (len(kinds) + 1)
    return [(seconds * 0.1 + slot * (i + 1) + rng.uniform(-0.3, 0.3) * slot, k) for i, k in enumerate(kinds)]


def _until(soak: Soak, at: float, stop: threading.Event) -> bool:
    """Sleep until `at` seconds into the run; False when the soak stopped first."""
    while time.time() - soak.started < at:
        if stop.wait(1.0):
            return False
    return True


def run_faults(soak: Soak, ledger: Ledger, plan: list[tuple[float, str]], stop: threading.Event) -> None:
    """The plan's faults but the worker's, in order (the worker's waits for a training: run_worker_fault)."""
    seen: dict[str, int] = {}
    for at, kind in plan:
        if kind == "worker":
            continue
        if not _until(soak, at, stop):
            return
        try:
            if kind == "gateway":
                _gateway(soak, ledger, seen.get(kind, 0))
            elif kind == "mlflow":
                _mlflow(soak)
            else:
                _restart(soak, ledger, kind)
        except Exception as err:  # noqa: BLE001 -- a fault that could not be injected is reported, the soak goes on
            soak.event("fault", fault=kind, what=f"injection failed: {err!r}", recovery_s=None, injected=False)
        seen[kind] = seen.get(kind, 0) + 1


def run_worker_fault(soak: Soak, plan: list[tuple[float, str]], seconds: float, stop: threading.Event) -> None:
    """The worker's faults: from each planned time, at the next training (until `seconds` into the run)."""
    for nth, at in enumerate(at for at, kind in plan if kind == "worker"):
        if not _until(soak, at, stop):
            return
        try:
            _worker(soak, nth, soak.started + seconds)
        except Exception as err:  # noqa: BLE001
            soak.event("fault", fault="worker", what=f"injection failed: {err!r}", recovery_s=None, injected=False)


def sample(soak: Soak, engine: sa.Engine, arms_seen: dict) -> None:
    """Arms (promotions, rollbacks become events), processes, memory, disk, the store's size."""
    with contextlib.suppress(sa.exc.SQLAlchemyError):
        with engine.connect() as conn:
            arms = {a.name: a.model_version for a in read_arms(conn)}
            rows = conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar()
            db_bytes = conn.execute(sa.text("SELECT pg_database_size(current_database())")).scalar()
        before = dict(arms_seen)
        if before and arms != before:
            if arms.get(CHAMPION) != before.get(CHAMPION):
                soak.event("promoted", version=arms.get(CHAMPION))
            elif CHALLENGER in before and CHALLENGER not in arms:
                soak.event("rolled back", version=before[CHALLENGER])
            elif CHALLENGER in arms:
                soak.event("challenger", version=arms[CHALLENGER])
        arms_seen.clear()
        arms_seen.update(arms)
        procs = []
        with contextlib.suppress(psutil.Error):
            procs = [psutil.Process(soak.up.pid), *psutil.Process(soak.up.pid).children(recursive=True)]
        rss = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                rss += proc.memory_info().rss
        soak.samples.append(
            {
                "t": time.time(), "processes": len(procs), "rss_mb": round(rss / 2**20, 1),
                "disk_mb": round(_du(soak.out) / 2**20, 1), "store_rows": rows, "store_mb": round(db_bytes / 2**20, 1),
            }
        )  # fmt: skip


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def run_samples(soak: Soak, engine: sa.Engine, stop: threading.Event) -> None:
    arms: dict = {}
    while not stop.is_set():
        sample(soak, engine, arms)
        stop.wait(SAMPLE_S)
