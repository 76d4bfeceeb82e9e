"""Load (bounded): concurrent editors against SQLite and PostgreSQL; nothing acknowledged is lost."""

from tests.support.harness import run_load


def test_concurrent_editors_lose_nothing(store_url):  # noqa: F811
    summary, problems = run_load(store_url, users=8, total=120, feedback_rate=0.7, seed=1)
    assert problems == []
    assert summary["errors"] == 0, summary["statuses"]
    assert summary["acked_completions"] == 120 == summary["stored_completions"]
    assert summary["acked_feedback"] == summary["stored_feedback"] > 50
    assert summary["p99_ms"] < 5000
