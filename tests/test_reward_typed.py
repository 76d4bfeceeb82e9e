"""What each user typed after a request, read from their next requests' prefixes (tasks/reward/typed.py)."""

import pyarrow.parquet as pq

from tasks.ingest.snapshot import run_ingest
from tasks.reward.reward import reward_metrics, reward_snapshot
from tasks.reward.typed import MIN_ANCHOR, continuations, typed_between
from tests.conftest import tiny_params
from tests.ingest_helpers import add_completions, add_feedback, completion_row, store

FILE = "import os\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n"


def test_typed_between_reads_the_text_added_to_the_prefix():
    assert typed_between(FILE[:40], FILE[:52]) == FILE[40:52]
    assert typed_between(FILE[:40], FILE[:40]) == ""  # nothing typed yet
    # an editor that caps the prefix sends its last N characters: the overlap is found inside it
    assert typed_between(FILE[10:60], FILE[25:75]) == FILE[60:75]
    assert typed_between("", "def f():") == "def f():"  # the first request in an empty file


def test_typed_between_refuses_a_deletion_or_another_place():
    assert typed_between(FILE[:60], FILE[:55] + "xyz") is None  # backspaced: the old prefix is not a head
    assert typed_between(FILE[:60], "something else entirely" * 3) is None
    # a short chance overlap (a few blanks) is not the same text typed on
    short = " " * 4
    assert len(short) < MIN_ANCHOR and typed_between("x" * 80 + short, short + "y") is None


def test_continuations_chain_a_users_requests_and_skip_other_users():
    suffix = "\n\nprint(read_config('a'))\n"
    # u1 types FILE in three pauses; u2's requests (another file) interleave; u1 then jumps to another file
    users = ["u1", "u2", "u1", "u2", "u1", "u1"]
    prefixes = [FILE[:45], "x = 1\n", FILE[:58], "x = 1\ny", FILE[:70], "other file\n"]
    suffixes = [suffix, "", suffix, "", suffix, ""]
    out = continuations(users, prefixes, suffixes, max_chars=200)
    assert out[0] == FILE[45:70]  # what u1 typed until their last request in this document
    assert out[2] == FILE[58:70]
    assert out[4] is None  # the next request is elsewhere: what followed is unknown
    assert out[1] == "y" and out[3] is None and out[5] is None
    assert continuations(users, prefixes, suffixes, max_chars=5)[0] == FILE[45:50]
    # the text after the cursor changed: not the same document (or an edit below), the chain breaks
    assert continuations(["u1", "u1"], [FILE[:45], FILE[:58]], ["a", "b"], 200) == [None, None]
    # rows of snapshots written before the editor's texts were logged have none
    assert continuations(["u1", "u1"], [None, FILE[:58]], [None, "a"], 200) == [None, None]


def test_the_rewarded_snapshot_carries_continuations_from_the_log(tmp_path):
    """Through the real log store and ingest: after a Tab the next prefix holds the suggestion, so an accepted
    suggestion starts its continuation; a rejected one's continuation is what the user typed instead."""
    params = tiny_params(tmp_path)
    suffix = "\n"
    with store("sqlite", tmp_path) as engine:
        add_completions(
            engine,
            [
                completion_row("a", 100.0, prefix=FILE[:39], suffix=suffix, completion="with open(path) as g:"),
                completion_row("b", 100.5, user="u2", prefix="y = 2\n", suffix=""),
                completion_row("c", 101.0, prefix=FILE[:76], suffix=suffix, completion="f.read()"),
                completion_row("d", 102.0, prefix=FILE, suffix=suffix, completion=""),
            ],
        )
        add_feedback(engine, "c", True, 101.5)
        ingest = run_ingest(engine, params, tmp_path, 200.0)
    assert pq.read_table(ingest.snapshot).column("prefix").to_pylist()[0] == FILE[:39]
    result = reward_snapshot(ingest.snapshot, params.reward, tmp_path / "rewarded.parquet", ingest.arms)
    table = pq.read_table(result.path)
    assert result.continued == 2 and reward_metrics(result)["reward/continued"] == 2
    rows = {r["completion_id"]: r for r in table.to_pylist()}
    assert rows["a"]["outcome"] == "rejected" and rows["a"]["continuation"] == FILE[39:]
    assert not rows["a"]["continuation"].startswith(rows["a"]["completion"])  # it wrote g, the user f
    assert rows["c"]["outcome"] == "accepted" and rows["c"]["continuation"] == FILE[76:]
    assert rows["b"]["continuation"] is None and rows["d"]["continuation"] is None
