"""The simulated editor over real HTTP behaves like Continue (issue 53): keystrokes debounced, one request in flight
per user, aborted when the user types on, an answer that came too late discarded (`shown: false`), outcomes only
for what was displayed; `simulator.client: waits` keeps the old editor that waits for every answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import sqlalchemy as sa

from serving.simulate import run_simulation, simulate_async
from tasks.core.procs import free_port
from tasks.core.store import CHALLENGER, CHAMPION, completions, feedback
from tasks.sim.users import make_users
from tests.conftest import tiny_params
from tests.serving_util import serve_app
from tests.support.harness import slow_challenger_gateway

SLOW_S = 0.8  # the challenger's answers come this much later (after its generation: tests/support/harness.py)


def _count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar_one()


def _simulate(tmp_path, tiny_model_dir, typing_regions, client: str, requests: int = 60):
    params = tiny_params(
        tmp_path,
        serving={"config_ttl_s": 0, "max_tokens": 8, "experiment_salt": "sim-http"},
        simulator={"client": client},
    )
    engine, app = slow_challenger_gateway(params, tiny_model_dir, SLOW_S, "tiny/2")
    users = make_users(8, params.simulator)
    with serve_app(app) as url:
        by_arm = run_simulation(
            url,
            typing_regions,
            users,
            requests,
            None,
            concurrency=8,
            seed=0,
            traffic=params.traffic,
            simulator=params.simulator,
        )
        # the last hang-ups reach the gateway just after the editors moved on: wait until the log stops growing
        seen, steady_since = -1, time.monotonic()
        while time.monotonic() - steady_since < 1.0:
            if (n := _count(engine)) != seen:
                seen, steady_since = n, time.monotonic()
            time.sleep(0.05)
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(completions))}
        answers = {r.completion_id: r for r in conn.execute(sa.select(feedback))}
    engine.dispose()
    return by_arm, rows, answers


def test_a_continue_like_editor_aborts_superseded_requests_and_reports_only_what_it_displayed(
    tmp_path, tiny_model_dir, typing_regions
):
    by_arm, rows, answers = _simulate(tmp_path, tiny_model_dir, typing_regions, "continue")
    cancelled = {cid for cid, r in rows.items() if r.cancelled_at is not None}
    assert by_arm[CHALLENGER].cancelled >= 1  # the slow arm's answers were typed past: aborted
    # every abort the gateway saw is a cancelled row (one before it had read the request leaves none); every
    # answer the editor received is a row that is not cancelled
    assert 1 <= len(cancelled) <= sum(s.cancelled for s in by_arm.values())
    assert len(rows) - len(cancelled) >= sum(s.requests + s.not_shown for s in by_arm.values())
    assert by_arm[CHALLENGER].cancel_rate > by_arm[CHAMPION].cancel_rate
    assert cancelled.isdisjoint(answers)  # no outcome was sent for an aborted request
    not_shown = {cid for cid, a in answers.items() if a.shown is False}
    assert len(not_shown) == sum(s.not_shown for s in by_arm.values())
    assert all(not a.accepted for a in answers.values() if a.shown is False)
    assert all(a.accepted for a in answers.values() if a.shown is not False)  # a rejection is silence
    assert sum(s.logged for s in by_arm.values()) == 60 >= len(rows)


def test_the_old_editor_waits_for_every_answer(tmp_path, tiny_model_dir, typing_regions):
    by_arm, rows, answers = _simulate(tmp_path, tiny_model_dir, typing_regions, "waits", requests=24)
    assert all(r.cancelled_at is None for r in rows.values()) and len(rows) == 24
    assert all(a.shown is not False for a in answers.values())
    assert sum(s.cancelled + s.not_shown for s in by_arm.values()) == 0


def test_with_on_error_the_editors_go_on_through_a_gateway_that_is_down(tmp_path, typing_regions):
    """A soak's traffic (bench/soak): with on_error, every failed turn is reported and the simulation ends when the
    budget is spent; without it, the first failure stops the simulation, as before."""
    params = tiny_params(tmp_path, simulator={"client": "waits"})
    users = make_users(2, params.simulator)
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = (down, typing_regions, users, 3, None, 2, 0, params.traffic, params.simulator)
    failures: list[Exception] = []
    turns, _ = asyncio.run(simulate_async(*args, on_error=failures.append))
    assert turns == [] and len(failures) == 3
    assert all(isinstance(err, httpx.ConnectError) for err in failures)
    with pytest.raises(httpx.ConnectError):
        asyncio.run(simulate_async(*args))


def _suggestions_by_user(tmp_path, tiny_model_dir, typing_regions, concurrency: int, replay: bool) -> dict:
    """Each user's (prompt, suggestion) pairs, in its own order, after 30 requests of 6 waiting editors at
    temperature 1.0 through a gateway of two arms (the challenger answering later)."""
    params = tiny_params(
        tmp_path,
        serving={"config_ttl_s": 0, "max_tokens": 8, "temperature": 1.0, "experiment_salt": "sim-http"},
        simulator={"client": "waits", "replay": replay},
    )
    engine, app = slow_challenger_gateway(params, tiny_model_dir, 0.05, "tiny/2")
    users = make_users(6, params.simulator)
    with serve_app(app) as url:
        run_simulation(url, typing_regions, users, 30, None, concurrency, 0, params.traffic, params.simulator)
    c = completions.c
    with engine.connect() as conn:
        rows = conn.execute(sa.select(c.user_id, c.prompt, c.completion).order_by(c.seq)).all()
    engine.dispose()
    by_user: dict[str, list] = {}
    for user, prompt, completion in rows:
        by_user.setdefault(user, []).append((prompt, completion))
    return by_user


def test_replayed_traffic_is_the_same_however_its_requests_interleave(tmp_path, tiny_model_dir, typing_regions):
    """simulator.replay (what `python -m flows.demo --replay` runs): one editor at a time or six at once, each user
    asks its fixed share and gets the same suggestions, since each request carries its own seed; without it, who
    asks how much and what is drawn follow the order requests reach the models."""
    runs = {
        (c, replay): _suggestions_by_user(tmp_path / f"{c}-{replay}", tiny_model_dir, typing_regions, c, replay)
        for c in (1, 6)
        for replay in (True, False)
    }
    one, six = runs[1, True], runs[6, True]
    assert sorted(len(v) for v in one.values()) == [5] * 6
    assert one == six
    assert len({s for v in one.values() for _, s in v}) > 10  # sampled: the seeds, not greedy decoding, agree
    assert runs[1, False] != runs[6, False]
