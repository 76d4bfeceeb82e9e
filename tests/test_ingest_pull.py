"""Pull: the timeout rule at its boundary, abstentions, late feedback, out-of-order sequence numbers."""

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from tasks.core.config import IngestParams
from tasks.core.outcomes import outcome_of
from tasks.core.store import late_feedback, snapshots, watermarks
from tasks.ingest.snapshot import file_sha256, run_ingest
from tests.conftest import tiny_params
from tests.ingest_helpers import add_completions, add_feedback, completion_row, store

BACKENDS = ["sqlite", "postgres"]


def _params(tmp_path, **ingest):
    return tiny_params(tmp_path, ingest={"feedback_timeout_s": 10.0, "commit_grace_s": 30.0, **ingest})


def _outcomes(path) -> dict[str, str]:
    table = pq.read_table(path)
    return dict(zip(table.column("completion_id").to_pylist(), table.column("outcome").to_pylist(), strict=True))


def _rule(abstained, created_at, received_at, accepted, timeout, **row):
    ingest = IngestParams(feedback_timeout_s=timeout)
    fields = {"cancelled": False, "reports_outcomes": None, "shown": None, **row}
    return outcome_of(
        abstained=abstained,
        created_at=created_at,
        received_at=received_at,
        accepted=accepted,
        ingest=ingest,
        **fields,
    )


def test_outcome_rule_at_the_deadline():
    assert _rule(False, 100.0, None, None, 10.0) == ("rejected", False)
    assert _rule(False, 100.0, 110.0, True, 10.0) == ("accepted", False)  # at the deadline: in time
    assert _rule(False, 100.0, 110.001, True, 10.0) == ("rejected", True)  # after: late, rejected
    assert _rule(False, 100.0, 105.0, False, 10.0) == ("rejected", False)
    assert _rule(True, 100.0, 101.0, True, 10.0) == ("abstained", False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_boundary_abstention_and_deferral(tmp_path, backend):
    params, now = _params(tmp_path), 1000.0
    with store(backend, tmp_path) as engine:
        add_completions(
            engine,
            [
                completion_row("acc", 900.0),
                completion_row("timed-out", 990.0),  # deadline == now: decided, rejected
                completion_row("abstain", 990.0, completion=""),
                completion_row("young", 990.5),  # deadline after now: left for the next cycle
                completion_row("after-young", 900.0),  # older clock but later seq: waits behind `young`
            ],
        )
        add_feedback(engine, "acc", True, 905.0)
        add_feedback(engine, "young", True, 991.0)
        result = run_ingest(engine, params, tmp_path, now)
        assert _outcomes(result.snapshot) == {"acc": "accepted", "timed-out": "rejected", "abstain": "abstained"}
        assert (result.first_seq, result.last_seq, result.watermark, result.pending) == (1, 3, 3, 2)
        assert result.arms["all"].requests == 3 and result.arms["all"].shown == 2 and result.arms["all"].accepted == 1

        second = run_ingest(engine, params, tmp_path, now + 1.0)
        assert _outcomes(second.snapshot) == {"young": "accepted", "after-young": "rejected"}
        assert second.watermark == 5 and second.pending == 0
        with engine.connect() as conn:
            assert conn.execute(sa.select(watermarks.c.completion_seq)).scalar_one() == 5
            assert conn.execute(sa.select(sa.func.count()).select_from(snapshots)).scalar_one() == 2

        nothing = run_ingest(engine, params, tmp_path, now + 2.0)
        assert nothing.snapshot is None and nothing.watermark == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_late_feedback_is_recorded_once_and_never_rewrites_a_snapshot(tmp_path, backend):
    params = _params(tmp_path)
    with store(backend, tmp_path) as engine:
        add_completions(engine, [completion_row("a", 100.0), completion_row("b", 100.0), completion_row("c", 100.0)])
        add_feedback(engine, "b", True, 115.0)  # late already at the first cycle
        first = run_ingest(engine, params, tmp_path, 200.0)
        sha = file_sha256(first.snapshot)
        assert _outcomes(first.snapshot) == {"a": "rejected", "b": "rejected", "c": "rejected"}
        assert first.late_feedback == 1

        add_feedback(engine, "a", True, 250.0)  # arrives after the row was snapshotted as rejected
        add_completions(engine, [completion_row("d", 260.0)])
        second = run_ingest(engine, params, tmp_path, 300.0)
        assert second.late_feedback == 1
        assert file_sha256(first.snapshot) == sha and _outcomes(first.snapshot)["a"] == "rejected"
        third_rows = [completion_row("e", 300.0)]
        add_completions(engine, third_rows)
        third = run_ingest(engine, params, tmp_path, 400.0)
        assert third.late_feedback == 0  # already recorded
        with engine.connect() as conn:
            recorded = {r.completion_id: (r.snapshot, r.accepted) for r in conn.execute(sa.select(late_feedback))}
        assert recorded == {"a": (first.snapshot.name, True), "b": (first.snapshot.name, True)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sequence_gap_that_may_still_commit_holds_the_watermark(tmp_path, backend):
    """seq 3 is handed out but not committed yet (PostgreSQL): the cycle must not skip past it."""
    params, now = _params(tmp_path), 1000.0
    with store(backend, tmp_path) as engine:
        add_completions(
            engine,
            [
                completion_row("s1", 900.0, seq=1),
                completion_row("s2", 900.0, seq=2),
                completion_row("s4", 985.0, seq=4),
            ],
        )  # decided, but younger than the grace
        first = run_ingest(engine, params, tmp_path, now)
        assert first.watermark == 2 and set(_outcomes(first.snapshot)) == {"s1", "s2"}
        add_completions(engine, [completion_row("s3", 984.0, seq=3)])  # the slow insert commits
        second = run_ingest(engine, params, tmp_path, now + 1.0)
        assert list(_outcomes(second.snapshot)) == ["s3", "s4"] and second.watermark == 4

        add_completions(engine, [completion_row("s6", 900.0, seq=6)])  # 5 rolled back long ago
        third = run_ingest(engine, params, tmp_path, now + 2.0)
        assert list(_outcomes(third.snapshot)) == ["s6"] and third.watermark == 6


def test_untrainable_outcomes_count_in_stats_but_not_in_the_snapshot(tmp_path):
    params = _params(tmp_path)
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, [completion_row("t", 100.0), completion_row("n", 100.0, arm="challenger")])
        add_feedback(engine, "t", True, 101.0)
        add_feedback(engine, "n", True, 101.0, trainable=False)
        result = run_ingest(engine, params, tmp_path, 200.0)
        assert list(_outcomes(result.snapshot)) == ["t"]
        assert result.report["not_trainable"] == 1
        assert result.arms["challenger"].accepted == 1 and result.arms["all"].accepted == 2


def test_accepted_characters_are_what_the_client_reported(tmp_path):
    """The counts' accepted characters follow the A/B test's rule: feedback's accepted_chars, else the suggestion."""
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, [completion_row("long", 100.0, completion="x = 1 + 2"), completion_row("no", 100.0)])
        add_feedback(engine, "long", True, 101.0)  # reports 5 of the 9 characters
        add_feedback(engine, "no", False, 101.0)
        result = run_ingest(engine, _params(tmp_path), tmp_path, 200.0)
        assert result.arms["all"].accepted_chars == 5 and result.arms["champion"].accepted_chars == 5
