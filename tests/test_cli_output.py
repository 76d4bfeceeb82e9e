"""What scripts read of the CLI (issue 58, item 6): `--output json` on ab-status, arms and vllm status, and the
shell completion Typer installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from typer.testing import CliRunner

from flows.cli.main import app
from tasks.core.procs import free_port
from tasks.core.store import CHALLENGER, CHAMPION, Arm, open_store, replace_arms
from tests.conftest import tiny_params
from tests.ingest_helpers import add_completions, add_feedback, completion_row

runner = CliRunner()


def _sets(params) -> list[str]:
    return ["--set", f"paths.database_url={params.paths.database_url}"]


def test_ab_status_and_arms_print_one_json_document_for_scripts(tmp_path):
    params = tiny_params(tmp_path)
    with open_store(params.paths.database_url) as engine:
        arms = [
            Arm(CHAMPION, "m/1", "/models/a", "embedded", 0.5),
            Arm(CHALLENGER, "m/2", "/models/b", "embedded", 0.5),
        ]
        replace_arms(engine, arms)
        replace_arms(engine, [Arm(CHAMPION, "m.alpha/1", "/models/a", "embedded", 1.0, team="alpha")], "alpha")
        # after the arms were written (the A/B window's start) and before the command looks (its `now`): a look
        # counts only what exists as of its own clock
        now = time.time() + 0.01
        rows = [completion_row(f"c{i}", now, arm=[CHAMPION, CHALLENGER][i % 2], model_version="") for i in range(6)]
        add_completions(engine, [dict(r, model_version=["m/1", "m/2"][i % 2]) for i, r in enumerate(rows)])
        add_feedback(engine, "c0", True, now + 0.01)
    time.sleep(0.05)
    status = runner.invoke(app, ["ab-status", "--output", "json", *_sets(params)])
    assert status.exit_code == 0, status.output
    document = json.loads(status.output)  # nothing but the document on stdout
    assert sorted(document) == ["alpha", "org"]
    org = document["org"]
    assert org["arms"][CHAMPION]["model_version"] == "m/1" and org["arms"][CHAMPION]["accepted"] == 1
    assert org["arms"][CHAMPION]["pending"] + org["arms"][CHAMPION]["requests"] == 3
    assert org["rule"]["action"] == "continue" and document["alpha"]["rule"] is None
    listed = runner.invoke(app, ["arms", "-o", "json", *_sets(params)])
    assert listed.exit_code == 0, listed.output
    got = json.loads(listed.output)
    assert [(a["team"], a["name"], a["share"]) for a in got] == [
        ("alpha", CHAMPION, 1.0),
        ("org", CHALLENGER, 0.5),
        ("org", CHAMPION, 0.5),
    ]
    # what `arms --json FILE` reads back: the organisation's arms from the listing, unchanged
    (tmp_path / "arms.json").write_text(json.dumps([{k: v for k, v in a.items() if k != "team"} for a in got[1:]]))
    again = runner.invoke(app, ["arms", "--json", str(tmp_path / "arms.json"), "-o", "json", *_sets(params)])
    assert again.exit_code == 0 and json.loads(again.output) == got
    bad = runner.invoke(app, ["arms", "--output", "yaml", *_sets(params)])
    assert bad.exit_code == 2 and "yaml" in bad.output


def test_vllm_status_says_in_json_which_server_did_not_answer(tmp_path):
    params = tiny_params(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with open_store(params.paths.database_url) as engine:
        replace_arms(engine, [Arm(CHAMPION, "m/1", url, "vllm", 1.0, "m-v1-abc", "/adapters/v1")])
    result = runner.invoke(app, ["vllm", "status", "--output", "json", *_sets(params)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["server"] == url and row["model"] is None and "unreachable" in row["error"]


def test_the_shell_completion_completes_commands_and_options():
    shown = runner.invoke(app, ["--show-completion", "bash"], prog_name="tabrl")
    assert shown.exit_code == 0 and "_TABRL_COMPLETE=complete_bash" in shown.output
    env = {**os.environ, "_TABRL_COMPLETE": "complete_bash", "COMP_WORDS": "tabrl ab-", "COMP_CWORD": "1"}
    done = subprocess.run([sys.executable, "-m", "flows.cli"], env=env, capture_output=True, text=True, timeout=120)
    assert "ab-status" in done.stdout.split(), (done.stdout, done.stderr[-2000:])
    env |= {"COMP_WORDS": "tabrl ab-status --o", "COMP_CWORD": "2"}
    done = subprocess.run([sys.executable, "-m", "flows.cli"], env=env, capture_output=True, text=True, timeout=120)
    assert "--output" in done.stdout.split(), (done.stdout, done.stderr[-2000:])
