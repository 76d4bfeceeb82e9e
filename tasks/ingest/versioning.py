"""Versioning a snapshot with DVC: `dvc add`, `dvc push` to the remote other hosts reach, a git commit of its
`.dvc` file; and the md5 DVC recorded."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import yaml

log = logging.getLogger(__name__)


class IngestError(RuntimeError):
    """A cycle that cannot complete (a racing ingest, a failing DVC command); the message says which."""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise IngestError(
            f"`{' '.join(cmd[-3:])}` failed in {cwd} (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return proc


def ensure_repo(path: Path) -> Path:
    """The git + DVC repository at `path`, made when missing (git init with an identity of its own, dvc init,
    analytics off, one commit): where snapshots are versioned, not the project's checkout."""
    if (path / ".dvc").is_dir() and (path / ".git").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "config", "user.name", "tabrl"],
        ["git", "config", "user.email", "tabrl@localhost"],
        [sys.executable, "-m", "dvc", "init", "-q"],
        [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
        ["git", "commit", "-qm", "tabrl interaction snapshots"],
    ):
        _run(cmd, path)
    return path


def version_with_dvc(repo_dir: Path, path: Path, remote: str | None = None) -> str:
    """``dvc add`` the snapshot, ``dvc push`` it to `remote` (when given) and commit its .dvc file (only
    those paths); skip with a warning outside DVC."""
    if not (repo_dir / ".dvc").is_dir():
        log.warning("%s is not a DVC repo (no .dvc/): snapshot %s is not versioned", repo_dir, path)
        return f"skipped: {repo_dir} is not a DVC repo"
    try:
        rel = path.resolve().relative_to(repo_dir.resolve())
    except ValueError:
        log.warning("snapshot %s is outside the DVC repo %s: not versioned", path, repo_dir)
        return f"skipped: {path} is outside {repo_dir}"
    _run([sys.executable, "-m", "dvc", "add", "-q", str(rel)], repo_dir)
    if remote is not None:  # before the commit: a committed .dvc file always has its data in the remote
        _run([sys.executable, "-m", "dvc", "push", "-q", "-r", remote, str(rel) + ".dvc"], repo_dir)
    pushed = f", pushed to {remote}" if remote is not None else ""
    if not (repo_dir / ".git").exists():
        return "added" + pushed
    tracked = [str(rel) + ".dvc", str(rel.parent / ".gitignore")]
    _run(["git", "add", "--", *tracked], repo_dir)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet", "--", *tracked], cwd=repo_dir)
    if staged.returncode == 1:
        _run(["git", "commit", "-q", "-m", f"ingest: snapshot {rel.name}", "--", *tracked], repo_dir)
    return "committed" + pushed


def dvc_md5(path: Path) -> str | None:
    """The md5 DVC recorded for `path` in `path.dvc` (what `dvc checkout` restores), None when not versioned."""
    meta = path.with_name(path.name + ".dvc")
    if not meta.is_file():
        return None
    outs = yaml.safe_load(meta.read_text()).get("outs") or [{}]
    md5 = outs[0].get("md5")
    return str(md5) if md5 else None
