"""The project's own Python files, as the tree-wide rules (sizes, layers, the architecture map) read them."""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_files(root: Path, packages: tuple[str, ...]) -> list[Path]:
    """The .py files under root's packages, less those git ignores (a bench's outputs under bench/out may hold
    copied third-party code: bench.teams copies six libraries there). Outside a git work tree nothing is ignored."""
    files = sorted(p for package in packages for p in (root / package).rglob("*.py"))
    names = "\n".join(p.relative_to(root).as_posix() for p in files)
    asked = subprocess.run(
        ["git", "-C", str(root), "check-ignore", "--stdin"], input=names, capture_output=True, text=True
    )
    ignored = set(asked.stdout.splitlines()) if asked.returncode in (0, 1) else set()  # 128: not a work tree
    return [p for p in files if p.relative_to(root).as_posix() not in ignored]
