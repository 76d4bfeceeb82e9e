"""`tabrl serve` (a real uvicorn subprocess on loopback) driven by `tabrl simulate`, plus keys/arms/import-continue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from flows.cli.main import app
from serving.log import prompt_hash
from tasks.core.procs import free_port, wait_until_up
from tasks.core.store import Store, completions, feedback, read_arms
from tasks.sim.editor import write_regions
from tests.conftest import tiny_params

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def served(tmp_path, tiny_model_dir):
    """`tabrl serve --model tiny` in a subprocess; yields (base URL, --set overrides, store URL)."""
    db = f"sqlite:///{tmp_path}/tabrl.db"
    port = free_port()
    sets = ["--set", f"paths.database_url={db}", "--set", "serving.max_tokens=8", "--set", "serving.config_ttl_s=0"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port), *sets],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        try:
            wait_until_up(f"http://127.0.0.1:{port}/healthz", proc, 60)
        except RuntimeError:
            log.flush()
            raise RuntimeError((tmp_path / "serve.log").read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}", sets, db
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_serve_and_simulate_over_http(served, tmp_path, typing_regions):
    url, sets, db = served
    regions = write_regions(typing_regions, tmp_path / "typing.parquet", tiny_params().traffic)
    result = runner.invoke(
        app,
        [
            "simulate",
            "--users",
            "4",
            "--requests",
            "12",
            "--url",
            url,
            "--regions",
            str(regions),
            "--concurrency",
            "3",
            "--json",
            str(tmp_path / "sim.json"),
            *sets,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "champion" in result.output and "suggestion" in result.output
    summary = json.loads((tmp_path / "sim.json").read_text())
    arm = summary["champion"]
    assert list(summary) == ["champion"] and arm["requests"] + arm["cancelled"] + arm["not_shown"] == 12
    engine = Store(db).engine
    time.sleep(0.5)  # an editor that hung up has moved on before the gateway logged the cancel
    with engine.connect() as conn:
        rows = conn.execute(sa.select(completions.c.user_id, completions.c.id)).all()
        n_feedback = conn.execute(sa.select(sa.func.count()).select_from(feedback)).scalar()
    assert arm["requests"] + arm["not_shown"] <= len(rows) <= 12 and len({r.user_id for r in rows}) == 4
    assert n_feedback == arm["accepted"] + arm["not_shown"]  # Tab, or "never shown", sends feedback; silence none

    # Arms: bad specs exit 2 naming the problem; a good change is picked up by the running gateway.
    bad = runner.invoke(app, ["arms", "--arm", "name=champion,uri=/models/x,share=0.7", *sets])
    assert bad.exit_code == 2 and "sum to 1" in bad.output
    model_uri = read_arms(engine)[0].model_uri
    good = runner.invoke(
        app,
        [
            "arms",
            "--arm",
            f"name=champion,uri={model_uri},share=0.5,version=tiny/1",
            "--arm",
            f"name=challenger,uri={model_uri},share=0.5,version=tiny/2",
            *sets,
        ],
    )
    assert good.exit_code == 0 and "challenger" in good.output
    again = runner.invoke(
        app,
        [
            "simulate",
            "--users",
            "8",
            "--requests",
            "16",
            "--url",
            url,
            "--regions",
            str(regions),
            "--json",
            str(tmp_path / "sim2.json"),
            *sets,
        ],
    )
    assert again.exit_code == 0, again.output
    assert sorted(json.loads((tmp_path / "sim2.json").read_text())) == ["challenger", "champion"]

    # The gateway's log (serving.log_format: json): one JSON object per line, one per request on the hot routes,
    # with the ids and the latency, never a prompt or a completion.
    lines = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("{")]
    served = [r for r in lines if r.get("name") == "tabrl.requests" and r["path"] == "/v1/completions"]
    with engine.connect() as conn:
        logged = dict(conn.execute(sa.select(completions.c.id, completions.c.model_version)).all())
    answered = [r for r in served if r["status"] == 200]
    assert answered and {r["completion_id"] for r in answered} <= set(logged)
    for r in answered:
        assert r["model_version"] == logged[r["completion_id"]] and r["team"] == "org" and r["latency_ms"] > 0
        assert {"user", "arm", "arm_team", "level", "asctime", "shown"} <= set(r) and "prompt" not in r
    assert {r["arm"] for r in answered} == {"champion", "challenger"}
    outcomes = [r for r in lines if r.get("name") == "tabrl.requests" and r["path"] == "/v1/feedback"]
    with engine.connect() as conn:
        stored = set(conn.execute(sa.select(feedback.c.completion_id)).scalars())
    assert {r["completion_id"] for r in outcomes if r["outcome"] == "recorded"} == stored
    engine.dispose()


def test_keys_and_import_continue(tmp_path):
    db = f"sqlite:///{tmp_path}/tabrl.db"
    sets = ["--set", f"paths.database_url={db}"]
    added = runner.invoke(app, ["keys", "add", "alice", *sets])
    assert added.exit_code == 0 and added.output.strip().startswith("tabrl-")
    assert runner.invoke(app, ["keys", "opt-out", "alice", *sets]).exit_code == 0
    engine = Store(db).engine
    with engine.begin() as conn:  # one completion the gateway had logged
        conn.execute(
            completions.insert().values(
                id="cmpl-1",
                created_at=0.0,
                user_id="alice",
                arm="champion",
                model_version="tiny/1",
                prompt="P",
                prefix="p",
                suffix="s",
                completion="C",
                token_ids=[1],
                logprobs=[-0.1],
                temperature=0.7,
                latency_ms=5.0,
                abstained=False,
                prompt_hash=prompt_hash("P", "C"),
            )
        )
    events = tmp_path / "autocomplete.jsonl"
    events.write_text(
        "\n".join(
            [
                json.dumps({"accepted": True, "time": 80, "prompt": "P", "completion": "C", "completionId": "u-1"}),
                json.dumps({"accepted": False, "time": 90, "prompt": "Q", "completion": "D", "completionId": "u-2"}),
                "{broken",
                json.dumps({"accepted": True, "prompt": "P", "completion": "C", "completionId": "u-1"}),
            ]
        )
        + "\n"
    )
    result = runner.invoke(app, ["import-continue", str(events), *sets])
    assert result.exit_code == 0, result.output
    assert "recorded=2" in result.output and "matched=1" in result.output and "bad=1" in result.output
    assert "duplicate=1" in result.output and "line 3" in result.output
    with engine.connect() as conn:
        rows = {r.completion_id: r for r in conn.execute(sa.select(feedback))}
    assert set(rows) == {"cmpl-1", "u-2"} and rows["cmpl-1"].matched and not rows["u-2"].matched
    assert rows["cmpl-1"].source == "import"
    missing = runner.invoke(app, ["import-continue", str(tmp_path / "nope.jsonl"), *sets])
    assert missing.exit_code == 2 and "not found" in missing.output
    engine.dispose()
