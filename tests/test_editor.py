"""Editor-like traffic: pauses, the cursor, Tab, characters saved, pre-training samples."""

import pytest

from tasks.core.config import Persona, load_params
from tasks.sim.editor import (
    Region,
    pause_requests,
    pick_regions,
    read_regions,
    stop_of,
    training_samples,
    write_regions,
)
from tasks.sim.sessions import Session, covered_chars, run_sessions, summarise_turns
from tasks.sim.users import SimUser

TRAFFIC = load_params(None, ["traffic.p_midword_pause=0"], environ={}).traffic
FILE = "import os\n\ndef main(path):\n    value = os.path.join(path, 'x')\n    return value\n"
STRICT = Persona(name="strict", min_accept_chars=4)


def region_of(first_line: str, last_line: str) -> Region:
    start = FILE.index(first_line)
    end = FILE.index(last_line) + len(last_line)
    return Region("r1", "m.py", FILE, start, end)


def test_pauses_sit_where_an_editor_asks():
    region = region_of("value = os", "return value")
    asked = [q["prefix"][len(FILE[: region.start]) :] for q in pause_requests(region, TRAFFIC)]
    # the line start, after '=', '.', '(', ',' and at word boundaries; the new line is auto-indented
    assert asked[:6] == ["", "value ", "value = ", "value = os.", "value = os.path.", "value = os.path.join("]
    assert "value = os.path.join(path, 'x')\n    " in asked  # cursor skipped the indentation
    q = next(pause_requests(region, TRAFFIC))
    assert q["middle"] == FILE[region.start : region.end] and q["suffix"] == FILE[region.end :]
    # mid-word pauses are a pure function of (region, position): the same in every run
    some = load_params(None, ["traffic.p_midword_pause=0.5"], environ={}).traffic
    assert list(pause_requests(region, some)) == list(pause_requests(region, some))
    assert len(list(pause_requests(region, some))) > len(asked)


def test_tab_jumps_the_cursor_and_counts_saved_characters():
    region = region_of("value = os", "return value")
    session = Session(region, SimUser("u", STRICT), TRAFFIC, seed=0)
    turn = session.answer("value = os.path")  # right: the user takes it
    assert turn.outcome == "accepted" and turn.right and turn.saved_chars == len("value = os.path")
    assert session.request()["prefix"].endswith("value = os.path.")  # next pause after the jump
    wrong = session.answer("listdir(")
    assert wrong.outcome == "rejected" and not wrong.right and wrong.saved_chars == 0
    assert covered_chars("a  b(c)", "a b(") == 5


def test_an_oracle_saves_almost_everything_and_a_silent_model_nothing():
    regions = [region_of("def main", "return value")]
    users = [SimUser("u", STRICT)]
    oracle, typed = run_sessions(regions, users, lambda qs: [q["middle"] for q in qs], 1, 4, 0, TRAFFIC)
    s = summarise_turns(oracle, typed)
    assert s.requests == 1 and s.accept_rate == 1.0 and s.chars_saved == 1.0
    silent, typed = run_sessions(regions, users, lambda qs: [""] * len(qs), 100, 4, 0, TRAFFIC)
    s = summarise_turns(silent, typed)
    assert 10 < s.requests < 100 and s.suggest_rate == 0.0 and s.chars_saved == 0.0  # the region ran out first
    assert typed == {"r1": regions[0].end - regions[0].start}
    cut, typed = run_sessions(regions, users, lambda qs: [""] * len(qs), 3, 4, 0, TRAFFIC)
    assert len(cut) == 3 and 0 < typed["r1"] < regions[0].end - regions[0].start  # stopped at the cursor
    noisy = SimUser("n", Persona(name="noisy", p_accept_wrong=1.0))
    turns, typed = run_sessions(regions, [noisy], lambda qs: ["zzzz"] * len(qs), 100, 4, 0, TRAFFIC)
    s = summarise_turns(turns, typed)
    assert s.accept_rate == 1.0 and s.right_rate == 0.0 and s.chars_saved == 0.0  # noise is never saved work


def test_two_models_type_the_same_regions_in_the_same_order(typing_regions):
    """What a paired comparison relies on (tasks/core/intervals.py): under the same request cap, the sessions two
    models type are the same regions in the same order, one list a prefix of the other."""
    from tasks.sim.acceptance import session_stats

    users = [SimUser("u", STRICT), SimUser("n", Persona(name="noisy", p_accept_wrong=0.5))]
    oracle = lambda qs: [q["middle"][:12] for q in qs]  # noqa: E731 - right, and the cursor jumps
    silent = lambda qs: [""] * len(qs)  # noqa: E731
    orders = []
    for suggest in (oracle, silent):
        turns, typed = run_sessions(typing_regions, users, suggest, 150, 4, 0, TRAFFIC)
        regions = [t.request["sample_id"].split("@")[0] for t in turns]
        orders.append(list(dict.fromkeys(regions)))
        assert len(session_stats(turns, typed)) == len(orders[-1])
    longer, shorter = sorted(orders, key=len, reverse=True)
    assert len(shorter) < len(longer) and longer[: len(shorter)] == shorter
    assert longer == [r.region_id for r in typing_regions if r.region_id in longer]


def test_stops_and_training_samples():
    assert stop_of("os.path.join(path)\n    x", "token", 4) == len("os.path")
    assert stop_of("value = 1\nnext", "line", 4) == len("value = 1")
    assert stop_of("a(b)\nc", "region", 4) == len("a(b)\nc")
    regions = [region_of("def main", "return value")]
    samples = training_samples(regions, 8, TRAFFIC, {"token": 1.0}, seed=0)
    assert len(samples) == 8 and all(s["span_kind"] == "typing-token" for s in samples)
    for s in samples:
        assert FILE.endswith(s["suffix"]) and (s["prefix"] + s["middle"]) in FILE


def test_regions_are_held_out_by_file_and_round_trip(stdlib_files, tmp_path):
    regions = pick_regions(stdlib_files, 20, TRAFFIC, seed=0, tag="t")
    assert len({r.region_id for r in regions}) == 20
    back = read_regions(write_regions(regions, tmp_path / "r.parquet", TRAFFIC))
    for a, b in zip(regions, back, strict=True):
        assert [q["prefix"][-50:] + "|" + q["middle"] for q in pause_requests(a, TRAFFIC)] == [
            q["prefix"][-50:] + "|" + q["middle"] for q in pause_requests(b, TRAFFIC)
        ]
    with pytest.raises(FileNotFoundError, match="dvc repro fim"):
        read_regions(tmp_path / "missing.parquet")
