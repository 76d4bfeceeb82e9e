"""A/B stats (timeout rule), the decision rule, promote / rollback, the CLI and the decision flow."""

import itertools
import os
import statistics

import numpy as np
import pytest
import sqlalchemy as sa
import yaml
from scipy import stats as st
from typer.testing import CliRunner

from tasks.core.store import (
    CHALLENGER,
    CHAMPION,
    Arm,
    Store,
    completions,
    feedback,
    init_schema,
    open_store,
    read_arms,
    replace_arms,
)
from tasks.deploy.ab import arm_stats, decide, live_since, stats_from_counts, two_proportion_test, welch_test
from tasks.deploy.promote import NoChallengerError, promote, rollback
from tasks.deploy.registry import Registry
from tasks.deploy.tracking import CycleRuns, tracking_client
from tests.conftest import tiny_params
from tests.support.harness import throwaway_schema

_ids = itertools.count()


def _engines(tmp_path):
    """SQLite, then PostgreSQL in a throwaway schema when TABRL_TEST_POSTGRES_URL is set."""
    with open_store(f"sqlite:///{tmp_path}/store.db") as engine:
        yield engine
    url = os.environ.get("TABRL_TEST_POSTGRES_URL")
    if url:
        with throwaway_schema(url) as schema_url, open_store(schema_url) as engine:
            yield engine


def _log(engine, arm, version, created, *, abstained=False, answer=None, answered_at=None, latency_ms=5.0):
    """One served completion, and its feedback when `answer` is given."""
    cid = f"c{next(_ids)}"
    with engine.begin() as conn:
        conn.execute(
            completions.insert().values(
                id=cid,
                created_at=created,
                user_id="u1",
                arm=arm,
                model_version=version,
                prompt="p",
                prefix="p",
                suffix="",
                completion="" if abstained else "x = 1",
                temperature=0.7,
                latency_ms=latency_ms,
                abstained=abstained,
                prompt_hash=cid,
            )
        )
        if answer is not None:
            conn.execute(
                feedback.insert().values(
                    completion_id=cid, matched=True, accepted=answer, received_at=answered_at, source="api"
                )
            )


def _ab_arms(engine, champion="m/1", challenger="m/2"):
    replace_arms(
        engine,
        [
            Arm(CHAMPION, champion, "/models/a", "embedded", 0.5),
            Arm(CHALLENGER, challenger, "/models/b", "embedded", 0.5),
        ],
    )


def test_arm_stats_apply_the_feedback_timeout_and_count_since_the_challenger_went_live(tmp_path):
    params = tiny_params(tmp_path, ingest={"feedback_timeout_s": 10.0})
    for engine in _engines(tmp_path):
        _log(engine, CHAMPION, "m/1", 1.0, answer=True, answered_at=2.0)  # before the A/B test: left out
        _ab_arms(engine)
        t0 = live_since(engine)
        now = t0 + 100
        _log(engine, CHAMPION, "m/1", t0 + 1, answer=True, answered_at=t0 + 3)  # accepted in time
        _log(engine, CHAMPION, "m/1", t0 + 1, answer=True, answered_at=t0 + 40)  # Tab too late: rejected
        _log(engine, CHAMPION, "m/1", t0 + 1, answer=False, answered_at=t0 + 2)  # explicit no
        _log(engine, CHAMPION, "m/1", t0 + 5, abstained=True)  # nothing shown
        _log(engine, CHAMPION, "m/1", t0 + 20)  # no answer, 80 s old: timed out = rejected
        _log(engine, CHAMPION, "m/1", now - 3)  # no answer, 3 s old: pending, left out
        _log(engine, CHAMPION, "m/1", now - 3, answer=False, answered_at=now - 1)  # young but answered: counts
        _log(engine, CHAMPION, "m/1", t0 + 1, answer=True, answered_at=now + 5)  # answer after `now`: not yet seen
        _log(engine, CHAMPION, "m/0", t0 + 1, answer=True, answered_at=t0 + 2)  # an older version under this name
        _log(engine, CHALLENGER, "m/2", t0 + 2, answer=True, answered_at=t0 + 4)

        stats = arm_stats(engine, params, now=now)
        champ, chall = stats[CHAMPION], stats[CHALLENGER]
        assert (champ.requests, champ.shown, champ.accepted, champ.rejected, champ.abstained) == (7, 6, 1, 5, 1)
        assert (champ.timed_out, champ.pending) == (2, 1)  # the late-answer-after-now row has timed out too
        assert champ.suggest_rate == pytest.approx(6 / 7) and champ.accept_rate == pytest.approx(1 / 6)
        r = params.reward
        assert champ.reward_per_request == pytest.approx((r.accepted + 5 * r.rejected + r.abstained) / 7)
        assert (chall.requests, chall.accepted, chall.model_version) == (1, 1, "m/2")
        # accepted characters: the feedback gave none, so the accepted suggestion's own length ("x = 1")
        assert champ.accepted_chars == 5 and champ.chars_per_request == pytest.approx(5 / 7)
        assert champ.accepted_chars_sq == 25 and champ.chars_std == pytest.approx(statistics.stdev([5] + [0] * 6))
        # The same store looked at a minute earlier: more rows are still pending.
        earlier = arm_stats(engine, params, now=t0 + 25)[CHAMPION]
        assert (earlier.requests, earlier.pending, earlier.timed_out, earlier.accepted) == (5, 1, 2, 1)


def test_latency_quantiles_cover_the_requests_the_stats_count(tmp_path):
    params = tiny_params(tmp_path, ingest={"feedback_timeout_s": 10.0})
    champion_ms = [12.0, 3.0, 40.0, 7.5, 100.0, 21.0, 5.0]
    for engine in _engines(tmp_path):
        _log(engine, CHAMPION, "m/1", 1.0, answer=True, answered_at=2.0, latency_ms=9000.0)  # before the test
        _ab_arms(engine)
        t0 = live_since(engine)
        now = t0 + 100
        for i, ms in enumerate(champion_ms):  # decided: answered, abstained or timed out
            _log(engine, CHAMPION, "m/1", t0 + 1 + i, answer=i % 2 == 0, answered_at=t0 + 2 + i, latency_ms=ms)
        _log(engine, CHAMPION, "m/1", t0 + 1, abstained=True, latency_ms=1.0)  # nothing shown: a request too
        _log(engine, CHAMPION, "m/1", now - 3, latency_ms=5000.0)  # pending: left out like everywhere else
        _log(engine, CHAMPION, "m/0", t0 + 1, answer=True, answered_at=t0 + 2, latency_ms=7000.0)  # older version
        _log(engine, CHALLENGER, "m/2", t0 + 1, answer=True, answered_at=t0 + 2, latency_ms=30.0)

        stats = arm_stats(engine, params, now=now)
        champ, chall = stats[CHAMPION], stats[CHALLENGER]
        counted = [*champion_ms, 1.0]
        assert champ.requests == len(counted)
        assert champ.latency.p50_ms == pytest.approx(np.quantile(counted, 0.5))  # 9.75
        assert champ.latency.p95_ms == pytest.approx(np.quantile(counted, 0.95))  # 79.0
        assert chall.latency.p50_ms == chall.latency.p95_ms == pytest.approx(30.0)
        assert not [k for k in decide(champ, chall, params).numbers if "latency" in k]  # shown, not a rule input
        assert arm_stats(engine, params, now=t0 + 0.5)[CHAMPION].latency is None  # no requests yet


def test_the_record_and_the_decision_numbers_keep_their_names():
    """decision.json's stats and MLflow's `ab/*` metrics are read by name: the counts type must not rename them."""
    params = tiny_params()
    a = stats_from_counts(CHAMPION, "m/1", 30, 50, 20, params.reward, timed_out=7, pending=2, accepted_chars=300)
    numbers = [
        "requests", "shown", "accepted", "rejected", "timed_out", "abstained", "pending", "cancelled",
        "not_shown", "cancel_rate", "suggest_rate", "accept_rate", "reward_per_request", "reward_std",
        "accepted_chars", "chars_per_request", "chars_std",
    ]  # fmt: skip
    record = a.as_record()
    assert list(record) == ["arm", "model_version", *numbers, "latency"]
    assert (record["requests"], record["shown"], record["chars_per_request"]) == (100, 80, 3.0)
    d = decide(a, stats_from_counts(CHALLENGER, "m/2", 45, 40, 15, params.reward), params)
    assert [k for k in d.numbers if k.startswith(f"{CHAMPION}_")] == [f"{CHAMPION}_{k}" for k in numbers]


def test_reward_stats_from_counts_match_the_raw_samples():
    params = tiny_params()
    a = stats_from_counts(CHAMPION, "m/1", 30, 50, 20, params.reward)
    b = stats_from_counts(CHALLENGER, "m/2", 45, 40, 15, params.reward)
    raw = [
        np.repeat([params.reward.accepted, params.reward.rejected, params.reward.abstained], counts)
        for counts in ((30, 50, 20), (45, 40, 15))
    ]
    assert a.reward_per_request == pytest.approx(raw[0].mean())
    assert a.reward_std == pytest.approx(raw[0].std(ddof=1))
    t, p = welch_test(a, b)
    ref = st.ttest_ind(raw[1], raw[0], equal_var=False)
    assert (t, p) == (pytest.approx(ref.statistic), pytest.approx(ref.pvalue))
    z, p = two_proportion_test(30, 80, 45, 85)
    pooled = 75 / 165
    assert z == pytest.approx((45 / 85 - 30 / 80) / np.sqrt(pooled * (1 - pooled) * (1 / 80 + 1 / 85)))
    assert p == pytest.approx(2 * st.norm.sf(abs(z)))


def _pair(champ, chall, params):
    return (
        stats_from_counts(CHAMPION, "m/1", *champ, params.reward),
        stats_from_counts(CHALLENGER, "m/2", *chall, params.reward),
    )


def test_decision_rule_minimum_samples_promote_rollback_and_continue():
    params = tiny_params(deploy={"min_samples": 100, "alpha": 0.05, "max_samples": 1000})
    # A huge difference but too few shown suggestions on one arm: keep collecting.
    d = decide(*_pair((10, 89, 0), (90, 9, 0), params), params)
    assert d.action == "continue" and "99/100" in d.reason
    assert d.numbers["challenger_accept_rate"] == pytest.approx(90 / 99)
    # Enough samples: better reward per request -> promote; worse -> roll back.
    assert decide(*_pair((30, 70, 0), (60, 40, 0), params), params).action == "promote"
    assert decide(*_pair((60, 40, 0), (30, 70, 0), params), params).action == "rollback"
    # No difference -> continue; still none at max_samples requests per arm -> roll back (inconclusive).
    assert decide(*_pair((50, 50, 0), (51, 49, 0), params), params).action == "continue"
    d = decide(*_pair((500, 500, 0), (502, 498, 0), params), params)
    assert d.action == "rollback" and "inconclusive" in d.reason
    # A challenger that abstains too often to show min_samples suggestions ends at max_samples too.
    assert decide(*_pair((500, 500, 0), (40, 40, 920), params), params).action == "rollback"


def test_showing_less_while_users_type_more_is_rolled_back_not_promoted():
    """Copilot's lesson: the challenger shows only short sure things. Its reward per request and accept
    rate are significantly higher, but users get fewer accepted characters per request."""
    params = tiny_params(deploy={"min_samples": 100, "alpha": 0.05, "max_samples": None, "chars_tolerance": 0.05})
    champion = stats_from_counts(CHAMPION, "m/1", 300, 700, 0, params.reward, accepted_chars=300 * 30)
    hacker = stats_from_counts(CHALLENGER, "m/2", 200, 100, 700, params.reward, accepted_chars=200 * 6)
    assert hacker.reward_per_request > champion.reward_per_request and hacker.accept_rate > champion.accept_rate
    assert hacker.chars_per_request == pytest.approx(1.2) and champion.chars_per_request == pytest.approx(9.0)
    d = decide(champion, hacker, params)
    assert d.action == "rollback" and d.reason.startswith("reward hacking"), d.reason
    assert d.numbers["chars_p"] < 0.05 and "significantly more than 5% fewer" in d.reason
    # The same challenger keeping users' characters (within the tolerance) is promoted.
    honest = stats_from_counts(CHALLENGER, "m/2", 200, 100, 700, params.reward, accepted_chars=int(9.0 * 1000 * 0.96))
    d = decide(champion, honest, params)
    assert d.action == "promote" and "not significantly more than 5% fewer" in d.reason, d.reason


def test_fewer_characters_on_a_few_accepts_is_noise_not_hacking():
    """Seed 0 of the demo, 2026-11-28: 11 accepts per arm; the challenger's characters per request 27 % below the
    champion's as point estimates, its reward significantly higher. Not evidence of showing less (one-sided
    p = 0.27): promoted. The same shortfall over 100 times the requests is evidence: rolled back."""
    params = tiny_params(deploy={"min_samples": 100, "alpha": 0.05, "max_samples": None, "chars_tolerance": 0.05})
    champion = stats_from_counts(CHAMPION, "m/1", 11, 151, 191, params.reward, accepted_chars=61)
    challenger = stats_from_counts(CHALLENGER, "m/3", 11, 138, 388, params.reward, accepted_chars=68)
    assert challenger.chars_per_request < 0.95 * champion.chars_per_request
    d = decide(champion, challenger, params)
    assert d.numbers["reward_p"] < 0.05 and d.numbers["chars_p"] == pytest.approx(0.2717, abs=1e-3)
    assert d.action == "promote", d.reason
    big = [
        stats_from_counts(s.arm, s.model_version, 100 * s.accepted, 100 * s.rejected, 100 * s.abstained,
                          params.reward, accepted_chars=100 * s.accepted_chars)
        for s in (champion, challenger)
    ]  # fmt: skip
    d = decide(*big, params)
    assert d.action == "rollback" and d.reason.startswith("reward hacking"), d.reason


def test_the_chars_spread_comes_from_the_squares_the_store_sums():
    """chars_std is the sample sd of per-request accepted characters: the squares of 3 accepts of 2, 4 and 9
    characters among 5 requests; without the squares, every accept is taken to be of the mean length."""
    params = tiny_params()
    s = stats_from_counts(CHAMPION, "m/1", 3, 1, 1, params.reward, accepted_chars=15, accepted_chars_sq=4 + 16 + 81)
    assert s.chars_std == pytest.approx(statistics.stdev([2, 4, 9, 0, 0]))
    least = stats_from_counts(CHAMPION, "m/1", 3, 1, 1, params.reward, accepted_chars=15)
    assert least.chars_std == pytest.approx(statistics.stdev([5, 5, 5, 0, 0]))


def test_accept_rate_route_needs_reward_not_lower():
    params = tiny_params(deploy={"min_samples": 100, "alpha": 0.05, "max_samples": None})
    # Challenger abstains more: accept rate clearly higher, reward per request equal -> promote.
    champ, chall = (100, 200, 0), (75, 50, 175)  # reward: 0.75*100-0.25*200 = 25 vs 0.75*75-0.25*50 = 43.75
    d = decide(*_pair(champ, chall, params), params)
    assert d.numbers["accept_p"] < 0.05 and d.numbers["reward_p"] >= 0.05 and d.numbers["reward_diff"] >= 0
    assert d.action == "promote" and "accept rate" in d.reason
    # Accept rate higher but reward per request estimate lower (and not significant): not promoted.
    champ, chall = (150, 150, 0), (100, 50, 150)  # reward 75/300 vs 62.5/300
    d = decide(*_pair(champ, chall, params), params)
    assert d.numbers["accept_p"] < 0.05 and d.numbers["reward_p"] >= 0.05 and d.numbers["reward_diff"] < 0
    assert d.action == "continue"


# --- promote / rollback -----------------------------------------------------------------------------


def _registry_with_challenger(params, model_dir):
    champion = Registry(params).ensure_champion(model_dir)
    challenger = Registry(params).register(model_dir, CycleRuns(params).start(run_name="cycle-1"))
    Registry(params).set_alias(CHALLENGER, challenger.version)
    return champion, challenger


def _live_arms(engine, champion, challenger):
    replace_arms(
        engine,
        [
            Arm(CHAMPION, champion.label, "/models/champ", "embedded", 0.5),
            Arm(CHALLENGER, challenger.label, "/models/chall", "embedded", 0.5),
        ],
    )


def _decision_runs(params):
    client = tracking_client(params)
    exp = client.get_experiment_by_name(params.deploy.decisions_experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def test_promote_and_rollback_change_arms_and_aliases(tmp_path, mlflow_store, tiny_model_dir):
    params = tiny_params(tmp_path, deploy={"min_samples": 1})
    registry = Registry(params)
    champion, challenger = _registry_with_challenger(params, tiny_model_dir)
    for engine in _engines(tmp_path):
        registry.set_alias(CHAMPION, champion.version)
        registry.set_alias(CHALLENGER, challenger.version)
        _live_arms(engine, champion, challenger)
        for i in range(4):
            _log(
                engine,
                CHALLENGER,
                challenger.label,
                live_since(engine) - 5 + i,
                answer=True,
                answered_at=live_since(engine) - 4 + i,
            )
        change = promote(engine, params)
        assert read_arms(engine) == [Arm(CHAMPION, challenger.label, "/models/chall", "embedded", 1.0)]
        assert registry.aliased(CHAMPION) == challenger and registry.aliased(CHALLENGER) is None
        assert [a.name for a in change.removed] == [CHAMPION] and change.removed[0].model_uri == "/models/champ"
        with pytest.raises(NoChallengerError, match="nothing to promote"):
            promote(engine, params)
        with pytest.raises(NoChallengerError, match="nothing to roll back"):
            rollback(engine, params)

        # Put the old champion back and test the new version again, then roll it back.
        registry.set_alias(CHAMPION, champion.version)
        registry.set_alias(CHALLENGER, challenger.version)
        _live_arms(engine, champion, challenger)
        change = rollback(engine, params)
        assert read_arms(engine) == [Arm(CHAMPION, champion.label, "/models/champ", "embedded", 1.0)]
        assert registry.aliased(CHAMPION) == champion and registry.aliased(CHALLENGER) is None
        assert [a.model_uri for a in change.removed] == ["/models/chall"]

        records = _decision_runs(params)
        assert sorted(r.data.tags["tabrl.action"] for r in records[:2]) == ["promote", "rollback"]
        assert all(r.data.tags["tabrl.reason"].startswith("by hand") for r in records[:2])
        cycle = tracking_client(params).get_run(challenger.run_id)
        assert cycle.data.tags["tabrl.ab_decision"] == "rollback"  # the challenger's cycle run knows its fate


def test_promote_restores_aliases_when_the_arm_swap_fails(tmp_path, mlflow_store, tiny_model_dir):
    params = tiny_params(tmp_path)
    registry = Registry(params)
    champion, challenger = _registry_with_challenger(params, tiny_model_dir)
    engine = next(_engines(tmp_path))
    _live_arms(engine, champion, challenger)
    with engine.begin() as conn:  # a real database failure inside the arm swap
        conn.execute(
            sa.text("CREATE TRIGGER arms_fail BEFORE INSERT ON arms BEGIN SELECT RAISE(ABORT, 'disk full'); END")
        )
    with pytest.raises(sa.exc.IntegrityError, match="disk full"):
        promote(engine, params)
    assert registry.aliased(CHAMPION) == champion and registry.aliased(CHALLENGER) == challenger
    assert {a.name: a.share for a in read_arms(engine)} == {CHAMPION: 0.5, CHALLENGER: 0.5}
    assert _decision_runs(params) == []  # no decision recorded for a change that did not happen


def _params_file(tmp_path, params):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    return path


def test_cli_promote_without_challenger_exits_2_and_rollback_works(tmp_path, mlflow_store, tiny_model_dir):
    from flows.cli.main import app

    params = tiny_params(tmp_path)
    registry = Registry(params)
    path = _params_file(tmp_path, params)
    champion = registry.ensure_champion(tiny_model_dir)
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    replace_arms(engine, [Arm(CHAMPION, champion.label, "/models/champ", "embedded", 1.0)])
    runner = CliRunner()
    result = runner.invoke(app, ["promote", "--params", str(path)])
    assert result.exit_code == 2 and "nothing to promote" in result.output

    challenger = registry.register(tiny_model_dir, CycleRuns(params).start())
    registry.set_alias(CHALLENGER, challenger.version)
    _live_arms(engine, champion, challenger)
    result = runner.invoke(app, ["ab-status", "--params", str(path)])
    assert result.exit_code == 0 and "collecting" in result.output
    assert "p95: latency" in result.output and " - " in result.output  # no requests yet: no latency
    for ms in (10.0, 20.0, 30.0, 40.0):
        _log(engine, CHALLENGER, challenger.label, live_since(engine), answer=True, answered_at=0.0, latency_ms=ms)
    result = runner.invoke(app, ["ab-status", "--params", str(path)])
    challenger_row = next(line for line in result.output.splitlines() if CHALLENGER in line)
    assert "25.0" in challenger_row and "38.5" in challenger_row, result.output  # p50 and p95 of 10..40
    result = runner.invoke(app, ["rollback", "--params", str(path)])
    assert result.exit_code == 0, result.output
    assert "champion is now" in result.output and [a.name for a in read_arms(engine)] == [CHAMPION]
    engine.dispose()


# --- the decision flow ------------------------------------------------------------------------------


def test_ab_decision_flow_continues_then_promotes(tmp_path, mlflow_store, tiny_model_dir, prefect_harness):
    from flows.ab_decision import ab_decision

    params = tiny_params(tmp_path, deploy={"min_samples": 30})
    path = str(_params_file(tmp_path, params))
    champion, challenger = _registry_with_challenger(params, tiny_model_dir)
    engine = Store(params.paths.database_url).engine
    init_schema(engine)
    _live_arms(engine, champion, challenger)
    t0 = live_since(engine)

    def serve(arm, label, accepted, rejected):
        for i in range(accepted + rejected):
            _log(engine, arm, label, t0 + 0.001 * i, answer=i < accepted, answered_at=t0 + 0.05)

    serve(CHAMPION, champion.label, 5, 15)
    serve(CHALLENGER, challenger.label, 15, 5)
    decision = ab_decision(path)["org"]
    assert decision.action == "continue" and "20/30" in decision.reason
    assert [a.name for a in read_arms(engine)] == [CHALLENGER, CHAMPION]
    assert [r.data.tags["tabrl.action"] for r in _decision_runs(params)] == ["continue"]

    serve(CHAMPION, champion.label, 5, 15)
    serve(CHALLENGER, challenger.label, 15, 5)
    decision = ab_decision(path)["org"]
    assert decision.action == "promote" and decision.numbers["reward_p"] < 0.05
    assert read_arms(engine) == [Arm(CHAMPION, challenger.label, "/models/chall", "embedded", 1.0)]
    assert Registry(params).aliased(CHAMPION) == challenger
    records = _decision_runs(params)
    assert records[0].data.tags["tabrl.action"] == "promote"
    assert records[0].data.metrics["ab/challenger_shown"] == 40

    decision = ab_decision(path)["org"]  # nothing under test any more
    assert decision.action == "continue" and "no A/B test" in decision.reason
    engine.dispose()


def test_decision_flow_retries_store_hiccups_but_not_states_that_need_a_person():
    from prefect.states import Failed

    from flows.ab_decision import _transient
    from tasks.deploy.registry import DeployError

    assert _transient(None, None, Failed(data=sa.exc.OperationalError("SELECT 1", {}, Exception("locked"))))
    assert not _transient(None, None, Failed(data=NoChallengerError("nothing to promote")))
    assert not _transient(None, None, Failed(data=DeployError("alias and arm disagree")))
