"""Reward: values from params, the three advantage modes, the rewarded snapshot, the per-arm summary."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from tasks.core.config import RewardParams
from tasks.core.schema import REWARDED_SCHEMA
from tasks.ingest.snapshot import run_ingest
from tasks.reward.reward import ADVANTAGES, cycle_summary, reward_metrics, reward_of, reward_snapshot
from tasks.sim.users import Summary
from tests.conftest import tiny_params
from tests.ingest_helpers import add_completions, add_feedback, completion_row, store


def test_reward_values_come_from_params():
    p = RewardParams()
    assert [reward_of(o, p) for o in ("accepted", "rejected", "abstained")] == [0.75, -0.25, 0.0]
    assert reward_of("accepted", RewardParams(accepted=2.0)) == 2.0
    with pytest.raises(ValueError, match="'maybe'"):
        reward_of("maybe", p)


def test_advantage_modes():
    r = np.array([0.75, -0.25, -0.25, 0.0])
    shown = np.array([True, True, True, False])
    assert np.allclose(ADVANTAGES["raw"](r, shown), r)
    assert np.allclose(ADVANTAGES["batch_mean"](r, shown), r - 0.0625)
    whitened = ADVANTAGES["batch_norm"](r, shown)
    assert abs(whitened.mean()) < 1e-12 and abs(whitened.std() - 1.0) < 1e-6
    assert np.all(ADVANTAGES["batch_norm"](np.full(5, -0.25), np.ones(5, bool)) == 0.0)  # no spread, no signal
    assert ADVANTAGES["batch_norm"](np.array([]), np.array([], bool)).size == 0


def test_shown_mean_balances_accepted_and_rejected():
    # one accept in ten shown suggestions, two rows showed nothing: the baseline is the shown rows' mean (-0.15)
    r = np.array([0.75] + [-0.25] * 9 + [0.0, 0.0])
    shown = np.array([True] * 10 + [False, False])
    adv = ADVANTAGES["shown_mean"](r, shown)
    assert adv[0] == pytest.approx(0.9) and np.allclose(adv[1:10], -0.1) and np.all(adv[10:] == 0.0)
    assert adv[shown].sum() == pytest.approx(0.0)  # accepted and rejected rows pull with equal total weight
    assert ADVANTAGES["raw"](r, shown)[shown].sum() < 0  # raw: the rejections' push wins
    assert np.all(ADVANTAGES["shown_mean"](np.zeros(3), np.zeros(3, bool)) == 0.0)  # nothing shown, no signal


@pytest.mark.parametrize("mode", ["raw", "batch_mean", "batch_norm", "shown_mean"])
def test_rewarded_snapshot_and_summary(tmp_path, mode):
    params = tiny_params(tmp_path, reward={"advantage": mode})
    with store("sqlite", tmp_path) as engine:
        add_completions(
            engine,
            [
                completion_row("a", 100.0),
                completion_row("b", 100.0, arm="challenger"),
                completion_row("c", 100.0, arm="challenger", completion=""),
                completion_row("d", 100.0, arm="challenger"),
            ],
        )
        add_feedback(engine, "b", True, 101.0)
        ingest = run_ingest(engine, params, tmp_path, 200.0)
    result = reward_snapshot(ingest.snapshot, params.reward, tmp_path / "rewarded.parquet", ingest.arms)
    table = pq.read_table(result.path)
    assert table.schema.equals(REWARDED_SCHEMA)
    rewards = table.column("reward").to_pylist()
    assert rewards == [-0.25, 0.75, 0.0, -0.25]
    shown = np.array([o != "abstained" for o in table.column("outcome").to_pylist()])
    assert shown.tolist() == [True, True, False, True]
    assert np.allclose(table.column("advantage").to_numpy(), ADVANTAGES[mode](np.array(rewards), shown))
    challenger = result.summary["challenger"]
    assert challenger["requests"] == 3 and challenger["suggest_rate"] == pytest.approx(2 / 3)
    assert challenger["accept_rate"] == 0.5 and challenger["reward_per_request"] == pytest.approx(0.5 / 3)
    assert result.summary["all"]["reward_per_request"] == pytest.approx(0.25 / 4)
    metrics = reward_metrics(result)
    assert metrics["reward/accept_rate"] == pytest.approx(1 / 3) and "reward/challenger/accept_rate" in metrics


def test_cycle_summary_counts_abstentions_as_requests():
    s = cycle_summary(
        {"x": Summary(accepted=1, rejected=3, abstained=6, accepted_chars=3, mean_len=3.0)}, RewardParams()
    )["x"]
    assert s == {
        "requests": 10,
        "suggest_rate": 0.4,
        "accept_rate": 0.25,
        "reward_per_request": pytest.approx((0.75 - 3 * 0.25) / 10),
    }


def test_reward_task_logs_to_mlflow(tmp_path):
    import mlflow

    from tasks.reward.task import reward_task

    assert reward_task.retries == 1
    params = tiny_params(tmp_path)
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, [completion_row("a", 100.0)])
        add_feedback(engine, "a", True, 101.0)
        ingest = run_ingest(engine, params, tmp_path, 200.0)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    with mlflow.start_run() as run:
        reward_task.fn(ingest.snapshot, params.reward, tmp_path / "r.parquet")
    metrics = mlflow.get_run(run.info.run_id).data.metrics
    assert metrics["reward/accept_rate"] == 1.0 and metrics["reward/reward_per_request"] == 0.75


def test_an_accepted_suggestion_earns_per_character_it_saved(tmp_path):
    """reward.accepted_per_char: a longer accepted suggestion earns more; rejections and abstentions do not
    change, nor does the reported reward per request (the per-outcome one the gate and the A/B test read)."""
    params = tiny_params(tmp_path, reward={"accepted_per_char": 0.1})
    with store("sqlite", tmp_path) as engine:
        add_completions(
            engine,
            [
                completion_row("short", 100.0, completion=")"),
                completion_row("long", 100.0, completion="self.assertEqual("),
                completion_row("wrong", 100.0, completion="return None"),
                completion_row("none", 100.0, completion=""),
            ],
        )
        add_feedback(engine, "short", True, 101.0)
        add_feedback(engine, "long", True, 101.0)
        ingest = run_ingest(engine, params, tmp_path, 200.0)
    result = reward_snapshot(ingest.snapshot, params.reward, tmp_path / "rewarded.parquet", ingest.arms)
    table = pq.read_table(result.path)
    by_id = dict(zip(table.column("completion").to_pylist(), table.column("reward").to_pylist(), strict=True))
    assert by_id[")"] == pytest.approx(0.75 + 0.1)
    assert by_id["self.assertEqual("] == pytest.approx(0.75 + 0.1 * 17)
    assert by_id["return None"] == -0.25 and by_id[""] == 0.0
    assert result.summary["all"]["reward_per_request"] == pytest.approx((0.75 * 2 - 0.25) / 4)
