"""The soak's stack: `tabrl up --gateways 2` in a repo of its own, its PostgreSQL schema and its Redis server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from flows.cli.console import console
from flows.online_loop import snapshot_repo
from flows.stack import supervisor_rpc
from tasks.core.config import load_params
from tasks.core.procs import free_port
from tasks.sim.editor import regions_path

ROOT = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 600.0  # a Prefect server's first start migrates its database: minutes on 2 slow cores


def pg_restart_command() -> list[str]:
    """pg_ctlcluster VERSION main restart for the one cluster Debian's packages installed."""
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if len(versions) != 1:
        raise SystemExit(f"error: cannot tell which PostgreSQL to restart ({versions}); pass --pg-restart CMD")
    return ["pg_ctlcluster", "--skip-systemctl-redirect", versions[0], "main", "restart"]


@dataclass
class Soak:
    """The running stack and what happened to it: events (faults, promotions, rollbacks) and samples."""

    out: Path
    repo: Path
    params_file: Path
    gateway: str
    prefect_api: str
    mlflow: str
    redis_port: int
    redis: subprocess.Popen
    up: subprocess.Popen
    pg_restart: list[str]
    started: float = field(default_factory=time.time)
    events: list[dict] = field(default_factory=list)  # faults, promotions, rollbacks: {t, kind, ...}
    samples: list[dict] = field(default_factory=list)

    def rpc(self):
        return supervisor_rpc(self.out / "state" / "up" / "supervisor.sock")

    def minutes(self, t: float) -> float:
        return (t - self.started) / 60

    def event(self, kind: str, **detail) -> dict:
        entry = {"t": time.time(), "kind": kind, **detail}
        self.events.append(entry)
        console.print(f"[{self.minutes(entry['t']):6.1f} min] {kind} {detail}", highlight=False)
        return entry


def start_redis(port: int, log: Path) -> subprocess.Popen:
    """A Redis of the soak's own (nothing on disk), answering on port."""
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT)  # noqa: SIM115
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        time.sleep(0.2)
    raise RuntimeError(f"redis-server did not start on port {port}: see {log}")


def write_params(out: Path, repo: Path, db_url: str, redis_port: int, cycle_every: float, decide_every: float):
    params = {
        "model": {"base_dir": str(ROOT / "models" / "tabrl-tiny")},
        "paths": {
            "state_dir": str(out / "state"),
            "models_dir": str(out / "state" / "models"),
            "database_url": db_url,
            "mlflow_tracking_uri": f"sqlite:///{out / 'state' / 'mlflow.db'}",
            "snapshots_repo": str(repo),  # the soak's own repo: the reconciliation reads its snapshots there
        },
        "serving": {"port": free_port(), "redis_url": f"redis://127.0.0.1:{redis_port}/0"},
        "deploy": {
            "cycle_every_minutes": cycle_every,
            "decision_every_minutes": decide_every,
            "max_samples": 1500,  # a soak wants several cycles: an undecided A/B test ends after 1500 per arm
        },
        # a training run lost with its worker is cancelled this long after the cycle started it
        "cluster": {"train_timeout_s": 300},
        # a snapshot a loaded 2-core machine trains well within that timeout, whatever the backlog (ingest.max_rows)
        "ingest": {"max_rows": 2000},
    }
    path = out / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def bring_up(args, out: Path, db_url: str) -> Soak:
    """The repo, Redis, params and `tabrl up`; returns once the stack says it is up."""
    for split in ("train", "test"):  # the editors type the train regions; the cycles' gate reads the test ones
        if not regions_path(ROOT / "data", split).exists():
            raise SystemExit(f"error: {regions_path(ROOT / 'data', split)} not found: run `make data` first")
    repo = snapshot_repo(out / "repo")
    (repo / "data").mkdir()
    (repo / "data" / "fim").symlink_to(ROOT / "data" / "fim")  # the gate's held-out regions
    redis_port = free_port()
    redis = start_redis(redis_port, out / "redis.log")
    minutes = args.minutes if args.minutes is not None else args.hours * 60
    cycle_every = args.cycle_every or (4.0 if minutes <= 20 else 8.0)
    params_file = write_params(out, repo, db_url, redis_port, cycle_every, args.decide_every)
    params = load_params(params_file, [])
    prefect_port, mlflow_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "flows.cli", "up", "--no-auth", "--gateways", "2", "--params", str(params_file)]
    cmd += ["--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "TABRL_"))}
    up = subprocess.Popen(
        cmd, cwd=repo, env=env, stdout=open(out / "up.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )  # fmt: skip
    soak = Soak(
        out, repo, params_file, f"http://127.0.0.1:{params.serving.port}", f"http://127.0.0.1:{prefect_port}/api",
        f"http://127.0.0.1:{mlflow_port}", redis_port, redis, up,
        args.pg_restart.split() if args.pg_restart else pg_restart_command(),
    )  # fmt: skip
    deadline = time.monotonic() + UP_TIMEOUT_S
    while "Ctrl-C stops everything" not in (out / "up.log").read_text():
        if up.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"tabrl up did not come up (exit {up.poll()}): see {out / 'up.log'}")
        time.sleep(1.0)
    took = time.time() - soak.started
    soak.started = time.time()  # the run's clock (traffic, faults, the plot) starts with the stack up
    soak.event("up", seconds=round(took, 1))
    return soak


def stop_stack(soak: Soak) -> list[str]:
    """SIGINT tabrl up (Ctrl-C) and wait; the processes that ran below it and are still alive after."""
    below = []
    with contextlib.suppress(psutil.Error):
        below = psutil.Process(soak.up.pid).children(recursive=True)
    soak.up.send_signal(signal.SIGINT)
    try:
        soak.up.wait(600)
    except subprocess.TimeoutExpired:
        os.killpg(soak.up.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(below, timeout=10)
    left = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline()[:4])}")
    return left
