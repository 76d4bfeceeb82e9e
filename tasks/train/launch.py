"""Run the training job (`tasks/train/ppo.py`) the right way for this machine, and read back its result.

* train.nproc = 1 on CPU: in this process (no process group, no launcher start-up).
* train.nproc > 1 on CPU: `torchrun --nproc_per_node N` (gloo ranks).
* GPUs: the `deepspeed` launcher (`--num_gpus N`, NCCL, ZeRO stage from params), always a child
  process so the GPU memory is given back when it ends; with train.hostfile and train.num_nodes it
  starts the ranks on every listed host (DeepSpeed's own multi-node launch, over pdsh/ssh).

A finished job leaves `OUT/train_result.json`; asking again for the same inputs (snapshot bytes,
starting checkpoint, train params) returns it without training, so a retried task that was killed
after the rename does not train twice, and one killed before it starts again from scratch (the
half-written temp dir is replaced).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from prefect import task

from tasks.core.adapters import AdapterBaseError, is_adapter
from tasks.core.config import Params
from tasks.core.procs import free_port
from tasks.train.policy import RESULT_FILE, StartError
from tasks.train.ppo import SnapshotError, TrainingDiverged, TrainResult, inputs_digest, train

REPO_ROOT = Path(__file__).resolve().parents[2]


class TrainError(RuntimeError):
    """The training job failed for a reason other than a guard (the message carries its last output lines)."""


def read_result(out_dir: str | Path) -> TrainResult:
    return TrainResult(**json.loads((Path(out_dir) / RESULT_FILE).read_text()))


def launch_train(
    snapshot: str | Path,
    from_dir: str | Path,
    out_dir: str | Path,
    params: Params,
    mlflow_run_id: str | None = None,
    base_dir: str | Path | None = None,
) -> TrainResult:
    """Train from_dir on snapshot into out_dir (an HF checkpoint, or an adapter with train.adapter = lora);
    per-step metrics go to mlflow_run_id (default: the active MLflow run, if any). base_dir: the base of an
    adapter from_dir (default: the path the adapter records). Raises TrainingDiverged / SnapshotError / TrainError."""
    snapshot, from_dir, out = Path(snapshot), Path(from_dir), Path(out_dir)
    if not (from_dir / "config.json").is_file() and not is_adapter(from_dir):
        raise TrainError(f"--from {from_dir} is neither a model directory (no config.json) nor a LoRA adapter")
    if not snapshot.is_file():
        raise SnapshotError(f"snapshot {snapshot} not found")
    digest = inputs_digest(snapshot, from_dir, params)
    if (out / RESULT_FILE).is_file():
        done = read_result(out)
        if done.inputs_sha256 == digest:
            return done
        raise TrainError(f"{out} holds a checkpoint trained on other inputs; choose another --out or delete it")
    if mlflow_run_id is None:
        import mlflow

        run = mlflow.active_run()
        mlflow_run_id = run.info.run_id if run else None
    tp = params.train
    gpus = torch.cuda.is_available()
    if tp.num_nodes > 1 and not gpus:
        raise TrainError(
            f"train.num_nodes = {tp.num_nodes} needs GPUs (DeepSpeed's multi-node launcher); this host has none"
        )
    if tp.nproc == 1 and not gpus and tp.engine != "deepspeed":
        return train(snapshot, from_dir, out, params, mlflow_run_id, base_dir)
    with tempfile.TemporaryDirectory(prefix="tabrl-train-") as tmp:
        resolved = Path(tmp) / "params.yaml"
        resolved.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
        job = [
            "--snapshot",
            str(snapshot.resolve()),
            "--from",
            str(from_dir.resolve()),
            "--out",
            str(out.resolve()),
            "--resolved-params",
            str(resolved),
        ]
        if mlflow_run_id:
            job += ["--mlflow-run-id", mlflow_run_id]
        if base_dir is not None:
            job += ["--base", str(Path(base_dir).resolve())]
        _run(launcher_command(tp.nproc, gpus, tp.num_nodes, tp.hostfile) + job)
    return read_result(out)


def launcher_command(nproc: int, gpus: bool, num_nodes: int = 1, hostfile: str | None = None) -> list[str]:
    """The launcher prefix that starts nproc ranks of tasks.train.ppo (per node, on num_nodes hosts of hostfile)."""
    port = str(free_port())
    if gpus:
        nodes = ["--hostfile", hostfile, "--num_nodes", str(num_nodes)] if hostfile else []
        return ["deepspeed", *nodes, "--num_gpus", str(nproc), "--master_port", port, "--module", "tasks.train.ppo"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        port,
        "-m",
        "tasks.train.ppo",
    ]


def _run(cmd: list[str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)  # progress bar and logs stay visible
            tail.append(line.rstrip())
        rc = proc.wait()
    if rc == 0:
        return
    for line in tail:
        for kind in (TrainingDiverged, SnapshotError, StartError, AdapterBaseError):
            marker = f"error: {kind.__name__}: "
            if marker in line:
                raise kind(line.split(marker, 1)[1])
    raise TrainError(f"training job exited with {rc}: {' '.join(cmd[:6])} ...\n" + "\n".join(tail))


def _retry_unless_guard(task, task_run, state) -> bool:
    """Retry crashes (a killed rank, a lost node), never a guard or bad data: those fail the same way again."""
    return not isinstance(
        state.result(raise_on_failure=False), (TrainingDiverged, SnapshotError, StartError, AdapterBaseError)
    )


@task(name="train", retries=1, retry_delay_seconds=10, retry_condition_fn=_retry_unless_guard)
def train_task(
    snapshot: str,
    from_dir: str,
    out_dir: str,
    params: Params,
    mlflow_run_id: str | None = None,
    base_dir: str | None = None,
) -> TrainResult:
    return launch_train(snapshot, from_dir, out_dir, params, mlflow_run_id, base_dir)
