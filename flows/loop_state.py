"""Resuming an online loop after its last finished cycle: a checkpoint of its state dir per cycle.

An online loop's state dir holds everything a cycle changes: the log store and the MLflow store
(SQLite), the registry's artifacts and trained candidates, the DVC repo of snapshots, the records of
the vLLM servers it started. After each finished cycle the whole dir is copied to
``STATE/checkpoints/last`` (SQLite files through SQLite's backup API, so a copy is consistent;
immutable weights and snapshots hard-linked, so a 538 MB base costs nothing), with ``loop.json``
saying which cycle it ends and which loop it belongs to (its params and size, `loop_identity`). A loop
resumed with the same identity goes back to that checkpoint, which drops whatever a killed cycle half did
(rows it logged, a run it opened), and goes on with the next cycle, up to as many cycles as it is now asked
for (a finished loop can be extended). Resuming under another identity is refused, naming the settings
that differ, and leaves the state dir as it was: a run that spans sessions is never wiped by a changed
setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tasks.core import vocab

CHECKPOINTS = "checkpoints"
META = "loop.json"
LINKED = (".safetensors", ".parquet")  # written once, never changed in place: shared between state and checkpoint
SQLITE = ".db"


def _copy_tree(src: Path, dst: Path) -> None:
    """src copied to dst (made anew): SQLite databases by backup, immutable big files hard-linked, the rest copied."""
    shutil.rmtree(dst, ignore_errors=True)
    for root, dirs, files in os.walk(src):
        here = Path(root)
        if here == src:
            dirs[:] = [d for d in dirs if d != CHECKPOINTS]
        target = dst / here.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            s, d = here / name, target / name
            if name.endswith((f"{SQLITE}-wal", f"{SQLITE}-shm")):
                continue  # the backup of the database holds their pages
            if name.endswith(SQLITE):
                with sqlite3.connect(s) as source, sqlite3.connect(d) as copy:
                    source.backup(copy)
            elif name.endswith(LINKED) and not s.is_symlink():
                os.link(s, d)
            else:
                shutil.copy2(s, d, follow_symlinks=False)


class LoopMismatch(ValueError):
    """A resume that the state dir's checkpoint does not fit: another loop's, or more cycles than asked for."""


def save_checkpoint(state: Path, identity: dict, cycle: int, rows: list[dict]) -> None:
    """The state after `cycle` finished, with the rows so far, as the loop's one checkpoint (replacing the last)."""
    checkpoint = state / CHECKPOINTS / "last"
    staging = state / CHECKPOINTS / "staging"
    _copy_tree(state, staging)
    meta = {"key": identity_key(identity), "identity": identity, "cycle": cycle, "rows": rows}
    (staging / META).write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(checkpoint, ignore_errors=True)
    staging.rename(checkpoint)


def restore_checkpoint(state: Path, identity: dict, cycles: int) -> dict | None:
    """{"cycle": the last finished cycle, "rows": its rows} with the state dir put back as it was after it; None
    (the state dir untouched) when there is no checkpoint. LoopMismatch, the state dir untouched, when the
    checkpoint is another loop's or holds more than `cycles` cycles."""
    checkpoint = state / CHECKPOINTS / "last"
    meta_file = checkpoint / META
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    if meta.get("key") != identity_key(identity):
        differ = identity_diff(meta.get("identity", {}), identity)
        raise LoopMismatch(
            f"{state} holds the checkpoint of another loop (after cycle {meta.get('cycle')}); it differs in "
            f"{differ or 'settings it did not record'}. Resume it with the same params and size, or start afresh "
            "in another state dir (or without resuming, which wipes this one)"
        )
    if meta["cycle"] > cycles:
        raise LoopMismatch(
            f"{state} holds a loop after cycle {meta['cycle']}, more than the {cycles} asked for; ask for "
            f"{meta['cycle']} or more cycles (its earlier models stay in its registry)"
        )
    for entry in state.iterdir():
        if entry.name != CHECKPOINTS:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    restored = state / CHECKPOINTS / "restoring"
    _copy_tree(checkpoint, restored)
    (restored / META).unlink()
    for entry in restored.iterdir():
        entry.rename(state / entry.name)
    restored.rmdir()
    return meta


def identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_diff(old: dict, new: dict, prefix: str = "") -> str:
    """The settings two loop identities differ in, as `key: old -> new` ("absent" where one lacks it)."""
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name, "absent"), new.get(name, "absent")
        if isinstance(a, dict) and isinstance(b, dict):
            inner = identity_diff(a, b, f"{prefix}{name}.")
            out += [inner] if inner else []
        elif a != b:
            out.append(f"{prefix}{name}: {a!r} -> {b!r}")
    return "; ".join(out)


@dataclass
class CycleRow:
    cycle: int
    arms_served: str  # arm=version pairs that served this cycle's traffic
    requests: int
    suggest_rate: float  # online, all arms
    accept_rate: float  # online, per shown suggestion
    right_rate: float  # online, per shown suggestion, noise-free rule
    chars_saved: float  # online, right-and-accepted characters per typed character
    reward_per_request: float  # online
    decision: str  # A/B decision taken after the traffic (or "-")
    cycle_status: vocab.CycleStatus | Literal["unknown"]  # unknown: a predicted row (flows/demo_plan.py)
    eval_judge_mean: float | None  # held-out FIM spans, the cycle's candidate
    eval_accept_rate: float | None  # held-out editor traffic (test files), the cycle's candidate
    eval_chars_saved: float | None
    eval_reward_per_request: float | None
    champion_eval_reward_per_request: float | None
    serving_eval: dict  # held-out metrics of the model serving after this cycle (empty when not evaluated)
    traffic_s: float = 0.0  # seconds of simulated typing through the gateway (serving)
    train_s: float = 0.0  # seconds of the update (0: the cycle trained nothing)
    evaluate_s: float = 0.0  # seconds of the gate's evaluation (candidate, champion, the lineage's mark)
    cycle_s: float = 0.0  # seconds of the whole cycle flow (ingest, reward, train, evaluate, register, roll out)
    typing_s: float = 0.0  # of evaluate_s, the seconds candidate and champion typed the held-out regions
