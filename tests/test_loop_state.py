"""Resuming an online loop (flows/loop_state.py): back to the last finished cycle, extended, or refused."""

from __future__ import annotations

import sqlite3

import pytest

from flows import online_loop
from flows.loop_state import LoopMismatch, restore_checkpoint, save_checkpoint
from tasks.core.config import load_params

IDENTITY = {"train": {"lr": 0.0002, "epochs": 1}, "loop": {"requests": 500, "users": 24, "seed": 0, "ab_test": False}}


def _state(tmp_path):
    """A state dir with a SQLite store, a model file and a nested file, as a loop leaves it after a cycle."""
    state = tmp_path / "state"
    (state / "models" / "v2").mkdir(parents=True)
    (state / "models" / "v2" / "adapter_model.safetensors").write_bytes(b"weights of v2")
    (state / "note.txt").write_text("after cycle 1")
    with sqlite3.connect(state / "tabrl.db") as db:
        db.execute("create table arms (name text, version int)")
        db.execute("insert into arms values ('champion', 2)")
    return state


def _arms(state):
    with sqlite3.connect(state / "tabrl.db") as db:
        return db.execute("select name, version from arms order by name").fetchall()


def _half_done_cycle(state):
    """What a killed cycle leaves: a row it logged, a file it wrote, a file it changed."""
    with sqlite3.connect(state / "tabrl.db") as db:
        db.execute("insert into arms values ('challenger', 3)")
    (state / "models" / "v3").mkdir()
    (state / "note.txt").write_text("cycle 2, half done")


def test_a_resumed_loop_goes_back_to_its_last_finished_cycle_and_may_be_given_more_cycles(tmp_path):
    state = _state(tmp_path)
    save_checkpoint(state, IDENTITY, 1, [{"cycle": 1}])
    _half_done_cycle(state)

    meta = restore_checkpoint(state, IDENTITY, cycles=3)  # asked for 3: one more than a 2-cycle loop would have run

    assert meta["cycle"] == 1 and meta["rows"] == [{"cycle": 1}]
    assert _arms(state) == [("champion", 2)]
    assert (state / "note.txt").read_text() == "after cycle 1"
    assert not (state / "models" / "v3").exists()
    assert (state / "models" / "v2" / "adapter_model.safetensors").read_bytes() == b"weights of v2"
    assert restore_checkpoint(tmp_path / "elsewhere", IDENTITY, cycles=3) is None  # no checkpoint: nothing to resume


def test_another_loops_checkpoint_is_refused_naming_what_differs_and_nothing_is_wiped(tmp_path):
    state = _state(tmp_path)
    save_checkpoint(state, IDENTITY, 2, [{"cycle": 1}, {"cycle": 2}])
    _half_done_cycle(state)
    other = {**IDENTITY, "train": {"lr": 0.0005, "epochs": 1, "adapter": "lora"}}

    with pytest.raises(LoopMismatch) as err:
        restore_checkpoint(state, other, cycles=3)
    assert "after cycle 2" in str(err.value)
    assert "train.lr: 0.0002 -> 0.0005" in str(err.value) and "train.adapter: 'absent' -> 'lora'" in str(err.value)
    assert "train.epochs" not in str(err.value)

    with pytest.raises(LoopMismatch, match="after cycle 2, more than the 1 asked for"):
        restore_checkpoint(state, IDENTITY, cycles=1)

    # both refusals left the state dir as the killed cycle left it, and the checkpoint in place
    assert _arms(state) == [("challenger", 3), ("champion", 2)]
    assert (state / "note.txt").read_text() == "cycle 2, half done"
    assert restore_checkpoint(state, IDENTITY, cycles=2)["cycle"] == 2
    assert _arms(state) == [("champion", 2)]


def test_the_loops_cli_refuses_to_resume_another_loops_state_with_a_sentence(tmp_path, capsys):
    state = _state(tmp_path)
    params = load_params("params.yaml", online_loop.loop_overrides([], state, 0))
    theirs = online_loop.loop_identity(params, requests=240, n_users=24, seed=0, ab_test=True)
    save_checkpoint(state, theirs, 1, [])

    code = online_loop.main(["--state", str(state), "--resume", "--requests", "120", "--set", "train.lr=1e-4"])

    assert code == 2
    said = capsys.readouterr().err
    assert said.startswith("error: ") and "another loop" in said
    assert "loop.requests: 240 -> 120" in said and "train.lr: 5e-05 -> 0.0001" in said
    assert _arms(state) == [("champion", 2)] and (state / "checkpoints" / "last" / "loop.json").is_file()
