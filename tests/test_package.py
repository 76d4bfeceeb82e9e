"""tabrl as an installable package (issue 58, item 4): the built wheel, installed outside the checkout (with
--no-deps over this environment, the checkout off sys.path), runs `tabrl init` and `tabrl params` with the package's
own defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tasks.core.config import Params

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABRL_")}
    env["PYTHONPATH"] = str(site)  # before site-packages, where this checkout's editable install points
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_installed_elsewhere_inits_a_params_file_of_its_own_defaults(tmp_path):
    dist, site, service = tmp_path / "dist", tmp_path / "site", tmp_path / "service"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)])
    assert built.returncode == 0
    (wheel,) = dist.glob("tabrl-*.whl")
    assert subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)]).returncode == 0

    where = _run([sys.executable, "-c", "import tasks, flows, serving; print(tasks.__file__)"], tmp_path, site)
    assert where.stdout.strip().startswith(str(site)), where  # the wheel's code, not the checkout's
    init = _run([sys.executable, "-m", "flows.cli", "init", str(service)], tmp_path, site)
    assert init.returncode == 0 and (service / "params.yaml").is_file(), init.stderr
    shown = _run([sys.executable, "-m", "flows.cli", "params"], service, site)  # params.yaml of the cwd
    assert shown.returncode == 0, shown.stderr
    resolved = dict(line.split(" = ", 1) for line in shown.stdout.splitlines())
    assert {k: json.loads(v) for k, v in resolved.items()} == Params().flat()  # the package's own defaults
    again = _run([sys.executable, "-m", "flows.cli", "init", str(service)], tmp_path, site)
    assert again.returncode == 1 and "exists" in again.stderr  # never overwritten
    outside = _run([sys.executable, "-m", "flows.cli", "params"], tmp_path, site)
    assert outside.returncode == 2 and "params.yaml" in outside.stderr and "not found" in outside.stderr
