"""The one counts type (issue 41 item 3): its derived counts, its rates, and its pricing through outcomes.py."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import sqlalchemy as sa

from tasks.core.config import IngestParams, RewardParams
from tasks.core.outcomes import (
    NEVER_SHOWN,
    OUTCOMES,
    ArmCounts,
    deadline,
    outcome_conditions,
    outcome_of,
    reward_of,
    reward_per_request,
    reward_std,
    taken_chars,
)
from tasks.core.store import completions, feedback
from tests.ingest_helpers import add_completions, completion_row, store


def _samples(counts: ArmCounts, reward: RewardParams) -> np.ndarray:
    """The per-request rewards the counts stand for, one value per request."""
    return np.array(
        [reward_of("accepted", reward)] * counts.accepted
        + [reward_of("rejected", reward)] * counts.rejected
        + [reward_of("abstained", reward)] * counts.abstained
    )


def test_requests_shown_and_rates_derive_from_the_three_outcomes():
    c = ArmCounts(accepted=3, rejected=5, abstained=2, accepted_chars=60)
    assert (c.requests, c.shown) == (10, 8)
    assert c.suggest_rate == 0.8 and c.accept_rate == 3 / 8 and c.chars_per_request == 6.0


def test_empty_counts_have_zero_rates_and_prices():
    c = ArmCounts(accepted=0, rejected=0, abstained=0, accepted_chars=0)
    assert (c.suggest_rate, c.accept_rate, c.chars_per_request) == (0.0, 0.0, 0.0)
    assert reward_per_request(c, RewardParams()) == 0.0 and reward_std(c, RewardParams()) == 0.0


def test_pricing_equals_the_mean_and_sample_std_of_the_rewards():
    reward = RewardParams()
    for c in (
        ArmCounts(accepted=30, rejected=50, abstained=20, accepted_chars=0),
        ArmCounts(accepted=1, rejected=0, abstained=0, accepted_chars=0),
        ArmCounts(accepted=0, rejected=7, abstained=0, accepted_chars=0),
    ):
        raw = _samples(c, reward)
        assert reward_per_request(c, reward) == pytest.approx(raw.mean())
        assert reward_std(c, reward) == (pytest.approx(raw.std(ddof=1)) if raw.size > 1 else 0.0)


def test_pricing_is_the_formula_it_replaced():
    """The simulator's and the A/B test's old formulas, written out: the numbers must not move."""
    reward = RewardParams()
    c = ArmCounts(accepted=45, rejected=40, abstained=15, accepted_chars=0)
    n, shown, acc = 100, 85, 45
    mean = (acc * reward.accepted + (shown - acc) * reward.rejected + (n - shown) * reward.abstained) / n
    squares = acc * reward.accepted**2 + (shown - acc) * reward.rejected**2 + (n - shown) * reward.abstained**2
    assert reward_per_request(c, reward) == mean
    assert reward_std(c, reward) == math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1))


def test_accepted_per_char_stays_out_of_the_pricing():
    """accepted_per_char shapes training only; the live and evaluated numbers price outcomes alone."""
    c = ArmCounts(accepted=2, rejected=1, abstained=1, accepted_chars=50)
    shaped = RewardParams(accepted_per_char=0.01)
    assert reward_per_request(c, shaped) == reward_per_request(c, RewardParams())


def test_counts_are_frozen_and_never_negative():
    c = ArmCounts(accepted=1, rejected=0, abstained=0, accepted_chars=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.accepted = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="rejected=-1"):
        ArmCounts(accepted=1, rejected=-1, abstained=0, accepted_chars=0)


def test_taken_characters_are_the_reported_count_else_the_whole_suggestion():
    assert taken_chars("accepted", "x = 1 + 2", 5) == 5
    assert taken_chars("accepted", "x = 1 + 2", None) == 9
    assert taken_chars("rejected", "x = 1 + 2", None) == 0 and taken_chars("abstained", "", None) == 0


# --- never shown: the rule for cancelled and not-shown completions, in Python and in SQL (issue 53) ---

INGEST = IngestParams(feedback_timeout_s=10.0, reported_timeout_s=60.0)


def _case(cancelled=False, abstained=False, reports=None, received=None, accepted=None, shown=None):
    return outcome_of(
        cancelled=cancelled,
        abstained=abstained,
        reports_outcomes=reports,
        created_at=100.0,
        received_at=received,
        accepted=accepted,
        shown=shown,
        ingest=INGEST,
    )


def test_never_shown_outcomes_and_a_reporting_clients_longer_wait():
    assert _case(cancelled=True, received=101.0, accepted=True) == ("cancelled", False)  # a hang-up wins
    assert _case(cancelled=True, abstained=True) == ("cancelled", False)
    assert _case(received=101.0, accepted=False, shown=False) == ("not_shown", False)  # the client said so
    assert _case() == ("rejected", False)  # a silent client's silence is a rejection ...
    assert _case(reports=True) == ("not_shown", False)  # ... a reporting client's is not
    assert _case(reports=True, received=150.0, accepted=False) == ("rejected", False)  # within its 60 s
    assert _case(reports=True, received=160.0, accepted=True) == ("accepted", False)  # at its deadline
    assert _case(reports=True, received=160.5, accepted=True) == ("not_shown", True)  # late: never used
    assert _case(reports=False, received=150.0, accepted=True) == ("rejected", True)  # 10 s for a silent one
    assert _case(abstained=True, reports=True) == ("abstained", False)
    assert set(NEVER_SHOWN).isdisjoint(OUTCOMES)
    with pytest.raises(ValueError, match="not one of"):
        reward_of("cancelled", RewardParams())  # never priced: never trained on


def test_never_shown_counts_are_in_no_rate():
    c = ArmCounts(accepted=3, rejected=5, abstained=2, accepted_chars=60, cancelled=6, not_shown=4)
    assert (c.requests, c.shown, c.logged) == (10, 8, 20)
    assert c.suggest_rate == 0.8 and c.accept_rate == 3 / 8 and c.chars_per_request == 6.0
    assert c.cancel_rate == 6 / 20
    assert reward_per_request(c, RewardParams()) == reward_per_request(
        dataclasses.replace(c, cancelled=0, not_shown=0), RewardParams()
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_sql_rule_is_the_python_rule(tmp_path, backend):
    """outcome_conditions (the A/B test's counts) gives every row the outcome outcome_of (ingest's) gives it, and
    leaves undecided the rows whose deadline is ahead: every combination of row and feedback, both stores."""
    rows, fb, expected = [], [], {}
    now = 200.0
    combos = itertools.product(
        (False, True),  # cancelled
        (False, True),  # abstained
        (None, False, True),  # reports_outcomes
        (None, 105.0, 150.0, 165.0),  # feedback received at (None: none)
        (False, True),  # accepted
        (None, True, False),  # shown
        (100.0, 195.0),  # created at: decided by `now` for both clients, or young
    )
    for i, (cancelled, abstained, reports, received, accepted, shown, created) in enumerate(combos):
        if received is None and (accepted or shown is not None):
            continue  # no feedback: one case
        if received is not None:
            received = created + (received - 100.0)  # 5, 50 or 65 s after it was served
        cid = f"c{i}"
        rows.append(
            completion_row(
                cid,
                created,
                completion="" if abstained else "x = 1",
                cancelled_at=created + 0.1 if cancelled else None,
                reports_outcomes=reports,
            )
        )
        if received is not None:
            fb.append({"cid": cid, "accepted": accepted, "received_at": received, "shown": shown})
        decided = deadline(created, reports, INGEST) <= now
        if received is not None and received > now:
            received, accepted, shown = None, None, None  # not arrived as of `now`
        outcome, _ = outcome_of(
            cancelled=cancelled,
            abstained=abstained,
            reports_outcomes=reports,
            created_at=created,
            received_at=received,
            accepted=accepted,
            shown=shown,
            ingest=INGEST,
        )
        if outcome in ("accepted", "rejected", "not_shown") and not decided and received is None:
            outcome = "pending"
        expected[cid] = outcome
    with store(backend, tmp_path) as engine:
        add_completions(engine, rows)
        with engine.begin() as conn:
            for item in fb:
                conn.execute(
                    feedback.insert().values(
                        completion_id=item["cid"],
                        matched=True,
                        accepted=item["accepted"],
                        shown=item["shown"],
                        received_at=item["received_at"],
                        source="api",
                        user_id="u1",
                        trainable=True,
                    )
                )
        o = outcome_conditions(completions, feedback, INGEST, now)
        names = ("cancelled", "abstained", "accepted", "not_shown", "pending")
        joined = completions.outerjoin(
            feedback, sa.and_(feedback.c.completion_id == completions.c.id, feedback.c.received_at <= now)
        )
        query = sa.select(completions.c.id, *(sa.case((getattr(o, n), 1), else_=0).label(n) for n in names))
        with engine.connect() as conn:
            got = {}
            for r in conn.execute(query.select_from(joined)):
                hits = [n for n in names if getattr(r, n)]
                assert len(hits) <= 1, (r.id, hits)
                got[r.id] = hits[0] if hits else "rejected"
    assert got == expected
