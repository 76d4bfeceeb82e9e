"""The always-on stack on one machine (`tabrl up`): every process a team runs, under supervisord.

supervisord (a well-kept process supervisor, `supervisor` on PyPI) runs the programs: it writes each one's
output to its own log file under `{paths.state_dir}/up/logs/`, restarts a program that dies (a gateway
killed by the kernel comes back in seconds, which an always-on service needs: honcho, foreman's Python
port, stops every process when one exits), stops each in its own process group, and answers
supervisorctl. This module writes its config from params and drives it over supervisord's XML-RPC
socket, the way supervisorctl does:

1. the Prefect server and the MLflow server start (the MLflow server serves paths.mlflow_tracking_uri's
   store; a tracking URI that is already a server, http://..., is used as it is);
2. once both answer, `tabrl deploy` registers the deployments on their pools with params' schedules;
3. on serving.backend=vllm, `tabrl vllm start` starts the champion's vLLM server and points the arms at it (the
   cycles start and retire the challengers' servers themselves, each recorded under `{paths.state_dir}/vllm/`);
   on the embedded backend a store with no arms gets the champion as its one arm (`serve_first_champion`);
4. a Prefect worker per pool (cluster.cpu_pool, cluster.gpu_pool) and the gateway start.

Stopping (Ctrl-C, SIGTERM) stops supervisord's programs, then every process seen below them that is still
alive (a process worker starts each flow run in a session of its own, which a program's process group does
not reach), then the vLLM servers recorded under the state dir. `stop` returns what it had to kill.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import xmlrpc.client
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from supervisor.xmlrpc import SupervisorTransport

from tasks.core.config import Params
from tasks.core.engines import engine_class
from tasks.core.procs import NotUp, wait_until_up

READY_TIMEOUT_S = 300.0  # a Prefect server's first start migrates its database: about a minute on 2 slow cores
STOP_WAIT_S = 30  # supervisord's grace after SIGTERM before SIGKILL, per program
TABRL = (sys.executable, "-m", "flows.cli")
FIRST = ("prefect", "mlflow")  # started with supervisord; the rest once the deployments are registered


@dataclass(frozen=True)
class Program:
    """One process supervisord runs: its command, where it answers when up (None: nothing to poll), and for a
    Prefect worker its pool (up once the Prefect server lists it online in that pool)."""

    name: str
    command: list[str]
    ready_url: str | None = None
    cwd: str | None = None
    worker_pool: str | None = None


@dataclass(frozen=True)
class Stack:
    """The processes of one `tabrl up`, and the files it keeps under `{paths.state_dir}/up/`."""

    params: Params
    programs: list[Program]
    home: Path  # {state_dir}/up: supervisord.conf, its socket, pid file and log, logs/<program>.log
    env: dict[str, str]  # every program's environment: PREFECT_API_URL, PREFECT_HOME, ...
    overrides: list[str]  # the --set every tabrl program gets (the MLflow server's URI among them)
    prefect_url: str
    mlflow_url: str
    gateway_url: str
    vllm: bool  # serving.backend serves from a vLLM server: start the champion's before the gateway
    args: list[str]  # --params FILE --set ... for every tabrl command of the stack
    params_file: Path

    @property
    def deploy(self) -> list[str]:
        """Registers the deployments on their pools, with params' schedules."""
        return [*TABRL, "deploy", "--repo", ".", *self.args]

    @property
    def vllm_start(self) -> list[str]:
        """Starts (or finds) the champion's vLLM server and points the arms at it."""
        return [*TABRL, "vllm", "start", *self.args]

    @property
    def conf(self) -> Path:
        return self.home / "supervisord.conf"

    @property
    def socket(self) -> Path:
        return self.home / "supervisor.sock"

    def log(self, name: str) -> Path:
        return self.home / "logs" / f"{name}.log"


def plan(
    params: Params, params_file: Path, overrides: list[str], prefect_port: int, mlflow_port: int, gateways: int
) -> Stack:
    """The stack these params describe on this machine (nothing is started): see the module docstring."""
    state = Path(params.paths.state_dir).resolve()
    host, port = "127.0.0.1", params.serving.port
    prefect_url = f"http://{host}:{prefect_port}/api"
    tracking = params.paths.mlflow_tracking_uri
    programs = [
        Program(
            "prefect",
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(prefect_port)],
            f"{prefect_url}/health",
        ),
    ]
    if not tracking.startswith(("http://", "https://")):
        programs.append(
            Program(
                "mlflow",
                [
                    *(sys.executable, "-m", "mlflow", "server", "--workers", "1", "--backend-store-uri", tracking),
                    *(
                        "--artifacts-destination",
                        str(state / "mlartifacts"),
                        "--host",
                        host,
                        "--port",
                        str(mlflow_port),
                    ),
                ],
                f"http://{host}:{mlflow_port}/health",
            )
        )
        tracking = f"http://{host}:{mlflow_port}"
    sets = [*overrides, f"paths.mlflow_tracking_uri={tracking}"]
    args = ["--params", str(params_file.resolve()), *(a for s in sets for a in ("--set", s))]
    for pool in (params.cluster.cpu_pool, params.cluster.gpu_pool):
        programs.append(
            Program(
                f"worker-{pool}",
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
                worker_pool=pool,
            )
        )
    gateway_url = f"http://{params.serving.host if params.serving.host != '0.0.0.0' else host}:{port}"
    programs.append(Program("gateway", [*TABRL, "serve", "--workers", str(gateways), *args], f"{gateway_url}/healthz"))
    env = {
        "PREFECT_API_URL": prefect_url,
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no job runner beside the tracking server
    }
    return Stack(
        params, programs, state / "up", env, sets, prefect_url.removesuffix("/api"), tracking, gateway_url,
        vllm=engine_class(params.serving.backend).remote, args=args, params_file=params_file.resolve(),
    )  # fmt: skip


def render(stack: Stack, cwd: Path) -> str:
    """supervisord.conf for the stack: every program restarts when it dies and stops as a process group."""
    esc = _escape
    lines = [
        "[supervisord]",
        "nodaemon=true",
        f"logfile={esc(stack.home / 'supervisord.log')}",
        f"pidfile={esc(stack.home / 'supervisord.pid')}",
        f"childlogdir={esc(stack.home / 'logs')}",
        f"directory={esc(cwd)}",
        "[unix_http_server]",
        f"file={esc(stack.socket)}",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "[supervisorctl]",
        f"serverurl=unix://{esc(stack.socket)}",
    ]
    for priority, program in enumerate(stack.programs, start=1):
        lines += [
            f"[program:{program.name}]",
            f"command={esc(shlex.join(program.command))}",
            f"directory={esc(program.cwd or cwd)}",
            f"autostart={'true' if program.name in FIRST else 'false'}",
            "autorestart=true",
            "startsecs=3",
            "startretries=10",
            f"priority={priority}",  # started in this order and stopped in the reverse
            "stopasgroup=true",
            "killasgroup=true",
            f"stopwaitsecs={STOP_WAIT_S}",
            "redirect_stderr=true",
            f"stdout_logfile={esc(stack.log(program.name))}",
            "stdout_logfile_maxbytes=50MB",
            "stdout_logfile_backups=3",
        ]
    return "\n".join(lines) + "\n"


def _escape(value: object) -> str:
    """supervisord expands %(name)s in its values: a literal % (a URL-encoded password) is written %%."""
    return str(value).replace("%", "%%")


class StackError(RuntimeError):
    """The stack could not come up; the message names the process and its log file."""


@dataclass
class Running:
    """A started supervisord and what was seen running below it (pid -> create time), for the stop."""

    stack: Stack
    proc: subprocess.Popen
    seen: dict[int, float] = field(default_factory=dict)

    def rpc(self):
        return supervisor_rpc(self.stack.socket)

    def look(self) -> None:
        """Remember every process below supervisord now: the stop kills those still alive after it."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen[child.pid] = child.create_time()
        except psutil.NoSuchProcess:
            pass  # supervisord has exited: the stop reports what is left of what was seen


def start(stack: Stack, cwd: Path) -> Running:
    """Write the config and start supervisord (the Prefect and MLflow servers start with it)."""
    if stack.socket.exists() and _answers(stack):
        raise StackError(f"a tabrl up already runs on this state dir ({stack.home}): stop it first")
    (stack.home / "logs").mkdir(parents=True, exist_ok=True)
    stack.socket.unlink(missing_ok=True)
    stack.conf.write_text(render(stack, cwd))
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.supervisord", "-c", str(stack.conf)],
        env={**os.environ, **stack.env},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=open(stack.home / "supervisord.err", "w"),  # noqa: SIM115 -- the child holds it
        start_new_session=True,  # Ctrl-C reaches this process only; it stops supervisord in order
    )
    return Running(stack, proc)


def supervisor_rpc(socket: Path):
    """supervisord's XML-RPC interface over its unix socket (what supervisorctl talks to)."""
    transport = SupervisorTransport(None, None, f"unix://{socket}")
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport).supervisor


def _answers(stack: Stack) -> bool:
    try:
        supervisor_rpc(stack.socket).getState()
        return True
    except (OSError, xmlrpc.client.Error):
        return False


def wait_ready(running: Running, names: list[str], timeout_s: float = READY_TIMEOUT_S) -> dict[str, float]:
    """Wait until each named program answers its ready URL; seconds each took. A program that dies for good
    (supervisord gave up restarting it) or stays silent raises StackError with its log's last lines."""
    started = time.monotonic()
    took = {}
    for program in (p for p in running.stack.programs if p.name in names):
        deadline = started + timeout_s
        while True:
            running.look()
            state = _state(running, program.name)
            if state in ("FATAL", "EXITED") or running.proc.poll() is not None:
                raise StackError(f"{program.name} stopped ({state}): {_tail(running.stack.log(program.name))}")
            if program.worker_pool is not None:
                if state == "RUNNING" and _worker_online(running.stack.env["PREFECT_API_URL"], program.worker_pool):
                    break
            elif program.ready_url is None and state == "RUNNING":
                break
            if program.ready_url is not None:
                try:
                    wait_until_up(program.ready_url, None, 1.0)
                    break
                except NotUp:
                    pass
            if time.monotonic() > deadline:
                raise StackError(
                    f"{program.name} did not come up within {timeout_s:.0f} s: see {running.stack.log(program.name)}"
                )
            time.sleep(0.5)
        took[program.name] = time.monotonic() - started
    return took


def _worker_online(api_url: str, pool: str) -> bool:
    """Whether the Prefect server lists a worker of `pool` as online: the worker has started and sent its first
    heartbeat (supervisord's RUNNING only says the process lives)."""
    try:
        answer = httpx.post(f"{api_url}/work_pools/{pool}/workers/filter", json={}, timeout=5.0)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and any(w.get("status") == "ONLINE" for w in answer.json())


def _state(running: Running, name: str) -> str:
    try:
        return running.rpc().getProcessInfo(name)["statename"]
    except (OSError, xmlrpc.client.Error):
        return "STARTING"  # supervisord is not answering yet


def _tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else ["(no log yet)"]
    return f"{log}, last lines:\n" + "\n".join(text[-lines:])


def run_step(running: Running, name: str, command: list[str], timeout_s: float = 600.0) -> None:
    """A one-shot command of the bring-up (the deployments, the champion's vLLM server), logged to
    logs/<name>.log; StackError with that log's end when it fails."""
    log = running.stack.log(name)
    with open(log, "w") as out:
        done = subprocess.run(
            command, env={**os.environ, **running.stack.env}, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    if done.returncode != 0:
        raise StackError(f"{name} failed (exit {done.returncode}): {_tail(log)}")


def serve_first_champion(stack: Stack) -> str | None:
    """On a store with no arms (a new stack), make the registry's champion the one live arm (the base model as
    version 1 on a new registry), as the demo starts: the arms then name what the champion alias names from the
    first request on. A store that has arms keeps them (a restarted stack resumes its A/B test). The label served,
    or None when the arms were left alone."""
    from tasks.core.config import load_params
    from tasks.core.engines.base import ServeError
    from tasks.core.store import open_store, read_arms
    from tasks.deploy.arms import serve_champion
    from tasks.deploy.errors import DeployError

    params = load_params(stack.params_file, stack.overrides)
    with open_store(params.paths.database_url) as engine:
        if read_arms(engine):
            return None
    try:
        return serve_champion(params).model_version
    except (ServeError, DeployError) as err:
        raise StackError(f"the champion could not be served: {err}") from err


def start_rest(running: Running) -> None:
    """Start the programs that wait for the deployments (the workers, the gateway)."""
    for program in running.stack.programs:
        if program.name not in FIRST:
            running.rpc().startProcess(program.name, False)


def stop(running: Running, grace_s: float = 20.0) -> list[str]:
    """Stop everything this stack started; the processes that had to be killed after supervisord stopped,
    as 'pid name' (a flow run's process, an orphan), and the vLLM servers stopped."""
    from tasks.core.vllm import recorded_servers, stop_vllm

    running.look()
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGTERM)  # supervisord stops its programs in reverse priority
        try:
            running.proc.wait(STOP_WAIT_S * len(running.stack.programs) + 30)
        except subprocess.TimeoutExpired:
            os.killpg(running.proc.pid, signal.SIGKILL)
            running.proc.wait()
    killed = _kill_left(running.seen, grace_s)
    if running.stack.vllm:
        for server in recorded_servers(running.stack.params):
            if server.pid is not None:
                stop_vllm(server.pid)
                killed.append(f"{server.pid} vllm {server.url}")
    return killed


def _kill_left(seen: dict[int, float], grace_s: float) -> list[str]:
    """SIGTERM, then SIGKILL after grace_s, each seen process still alive (the same pid and start time)."""
    left = []
    for pid, created in seen.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                left.append(proc)
        except psutil.NoSuchProcess:
            continue
    names = [f"{p.pid} {_name(p)}" for p in left]
    for proc in left:
        proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        proc.kill()
    return names


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:5])
    except psutil.Error:
        return "(gone)"
