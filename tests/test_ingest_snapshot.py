"""Snapshot: exactly-once under a crash before the watermark, deterministic bytes, DVC, Prefect/MLflow, CLI."""

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml
from typer.testing import CliRunner

import tasks.ingest.snapshot as snapshot_mod
from tasks.core.schema import INTERACTION_SCHEMA
from tasks.core.store import Store, init_schema, watermarks
from tasks.ingest.snapshot import IngestError, file_sha256, run_ingest
from tests.conftest import tiny_params
from tests.ingest_helpers import add_completions, add_feedback, completion_row, store


def _rows(n: int, start: int, t: float) -> list[dict]:
    return [
        completion_row(f"r{i:03d}", t, user=f"u{i % 4}", completion="" if i % 5 == 0 else f"y = {i}")
        for i in range(start, start + n)
    ]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_crash_between_snapshot_and_watermark_is_exactly_once(tmp_path, backend, monkeypatch):
    params = tiny_params(tmp_path, ingest={"chunk_rows": 7})  # several row groups
    with store(backend, tmp_path) as engine:
        add_completions(engine, _rows(30, 0, 100.0))
        for i in range(0, 30, 3):
            add_feedback(engine, f"r{i:03d}", i % 2 == 0, 101.0)

        def crash(*args, **kwargs):
            raise RuntimeError("injected crash after the snapshot, before the watermark")

        monkeypatch.setattr(snapshot_mod, "advance_watermark", crash)
        with pytest.raises(RuntimeError, match="injected"):
            run_ingest(engine, params, tmp_path, 200.0)
        monkeypatch.undo()
        written = list((tmp_path / "data" / "interactions").glob("interactions-*.parquet"))
        assert len(written) == 1
        crashed_sha = file_sha256(written[0])
        with engine.connect() as conn:
            assert conn.execute(sa.select(watermarks)).first() is None  # the old watermark (none)

        # Meanwhile more traffic arrives; the re-run must redo exactly the crashed cycle.
        add_completions(engine, _rows(10, 30, 150.0))
        add_feedback(engine, "r001", True, 180.0)  # late for a row of the crashed cycle
        redo = run_ingest(engine, params, tmp_path, 300.0)
        assert redo.recovered and redo.snapshot == written[0] and redo.sha256 == crashed_sha
        assert file_sha256(redo.snapshot) == crashed_sha and redo.watermark == 30 and redo.pending == 10
        assert pq.read_table(redo.snapshot).schema.equals(INTERACTION_SCHEMA)

        after = run_ingest(engine, params, tmp_path, 300.0)
        ids = [pq.read_table(s).column("completion_id").to_pylist() for s in (redo.snapshot, after.snapshot)]
        assert ids[0] + ids[1] == [f"r{i:03d}" for i in range(40)]  # every row once, none twice
        assert not after.recovered


def test_same_rows_give_the_same_bytes(tmp_path):
    shas = []
    for run in ("a", "b"):
        params = tiny_params(tmp_path / run, ingest={"chunk_rows": 4})
        with store("sqlite", tmp_path / run) as engine:
            add_completions(engine, _rows(20, 0, 100.0))
            shas.append(run_ingest(engine, params, tmp_path / run, 200.0).sha256)
    assert shas[0] == shas[1]


def test_a_racing_ingest_cannot_commit_twice(tmp_path, monkeypatch):
    params = tiny_params(tmp_path)
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, _rows(5, 0, 100.0))
        run_ingest(engine, params, tmp_path, 200.0)
        add_completions(engine, _rows(5, 5, 150.0))
        old = snapshot_mod.read_watermark

        def stale(conn, team):  # another ingest commits right after this one read the watermark
            seen = old(conn, team)
            with engine.begin() as c:
                c.execute(watermarks.update().values(completion_seq=7))
            return seen

        monkeypatch.setattr(snapshot_mod, "read_watermark", stale)
        with pytest.raises(IngestError, match="another ingest"):
            run_ingest(engine, params, tmp_path, 300.0)


def _log_at(url: str, rows: list[dict]) -> None:
    engine = Store(url).engine
    init_schema(engine)
    add_completions(engine, rows)
    engine.dispose()


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_snapshot_is_versioned_with_dvc_in_a_git_repo(tmp_path):
    repo = tmp_path / "project"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.name", "tabrl test")
    _git(repo, "config", "user.email", "test@tabrl.invalid")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], cwd=repo, check=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    params = tiny_params(tmp_path, paths={"data_dir": "data"})
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, _rows(6, 0, 100.0))
        result = run_ingest(engine, params, repo, 200.0)
    assert result.dvc == "committed"
    rel = result.snapshot.relative_to(repo)
    meta = yaml.safe_load((repo / f"{rel}.dvc").read_text())
    import hashlib

    assert meta["outs"][0]["md5"] == hashlib.md5(result.snapshot.read_bytes()).hexdigest() == result.dvc_md5
    assert f"ingest: snapshot {rel.name}" in _git(repo, "log", "--oneline")
    assert _git(repo, "status", "--porcelain") == ""  # the Parquet file is DVC's (git-ignored), the .dvc is committed
    with pytest.raises(subprocess.CalledProcessError):
        _git(repo, "ls-files", "--error-unmatch", str(rel))


def test_snapshot_is_pushed_to_the_dvc_remote_and_a_clone_pulls_it(tmp_path):
    """cluster.dvc_remote: another machine with a clone of the project gets the snapshot from the remote."""
    repo, remote = tmp_path / "project", tmp_path / "remote"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.name", "tabrl test")
    _git(repo, "config", "user.email", "test@tabrl.invalid")
    for args in (["init", "-q"], ["config", "core.analytics", "false"], ["remote", "add", "store", str(remote)]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, check=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    params = tiny_params(tmp_path, paths={"data_dir": "data"}, cluster={"dvc_remote": "store"})
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, _rows(6, 0, 100.0))
        result = run_ingest(engine, params, repo, 200.0)
    assert result.dvc == "committed, pushed to store"
    clone = tmp_path / "elsewhere"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    rel = result.snapshot.relative_to(repo)
    assert not (clone / rel).exists()
    subprocess.run([sys.executable, "-m", "dvc", "pull", "-q", "-r", "store", str(rel) + ".dvc"], cwd=clone, check=True)
    assert (clone / rel).read_bytes() == result.snapshot.read_bytes()


def test_outside_a_dvc_repo_versioning_is_skipped_with_a_warning(tmp_path, caplog):
    params = tiny_params(tmp_path)
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, _rows(3, 0, 100.0))
        result = run_ingest(engine, params, tmp_path, 200.0)
    assert result.dvc.startswith("skipped") and result.snapshot.is_file() and result.watermark == 3
    assert result.dvc_md5 is None
    assert "not a DVC repo" in caplog.text


def test_prefect_task_logs_namespaced_metrics_to_an_active_mlflow_run(tmp_path):
    import mlflow

    from tasks.ingest.task import commit_ingest_task, ingest_task

    assert ingest_task.retries == 2 and commit_ingest_task.retries == 2
    params = tiny_params(tmp_path)
    _log_at(params.paths.database_url, _rows(8, 0, 100.0))  # the task opens params.paths.database_url itself
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    with mlflow.start_run() as run:
        pending = ingest_task.fn(params, tmp_path, now=200.0)
        assert mlflow.get_run(run.info.run_id).data.metrics["ingest/watermark"] == 0  # not committed yet
        result = commit_ingest_task.fn(params, pending)
    logged = mlflow.get_run(run.info.run_id).data.metrics
    assert logged["ingest/rows"] == result.rows == 8
    tags = mlflow.get_run(run.info.run_id).data.tags  # the snapshot, found again from the run (no DVC here)
    assert tags["tabrl.snapshot_sha256"] == result.sha256 and "tabrl.snapshot_dvc_md5" not in tags
    assert tags["tabrl.snapshot"] == str(result.snapshot.relative_to(tmp_path))
    assert logged["ingest/clean/rows_in"] == 8 and logged["ingest/watermark"] == result.watermark == 8
    assert ingest_task.fn(params, tmp_path, now=201.0).result.snapshot is None  # no run active: nothing logged


def test_an_uncommitted_snapshot_is_written_again_with_the_same_rows(tmp_path):
    """A cycle whose training failed never commits: the next cycle gets the same range and bytes, and the rows
    logged since wait for the cycle after it (no row in two snapshots, none lost)."""
    from tasks.ingest.snapshot import commit_snapshot, write_snapshot

    params = tiny_params(tmp_path)
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, _rows(10, 0, 100.0))
        first = write_snapshot(engine, params, tmp_path, 200.0).result
        assert first.watermark == 0 and first.snapshot is not None and first.last_seq == 10
        add_completions(engine, _rows(5, 10, 150.0))
        again = write_snapshot(engine, params, tmp_path, 300.0)
        assert (again.result.snapshot, again.result.sha256, again.result.recovered) == (
            first.snapshot,
            first.sha256,
            True,
        )
        assert commit_snapshot(engine, params, again).watermark == 10
        later = run_ingest(engine, params, tmp_path, 300.0)
        assert (later.first_seq, later.last_seq, later.rows, later.watermark) == (11, 15, 5, 15)


def test_cli_prints_the_report_and_snapshot_path(tmp_path):
    from flows.cli.main import app

    params = tiny_params(tmp_path)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    _log_at(params.paths.database_url, _rows(4, 0, 100.0))
    out = CliRunner().invoke(app, ["ingest", "--repo", str(tmp_path), "--now", "200", "--params", str(params_file)])
    assert out.exit_code == 0, out.output
    assert "rows_out" in out.output and "interactions-000000000001-000000000004.parquet" in out.output
    bad = CliRunner().invoke(app, ["ingest", "--params", str(params_file), "--set", "ingest.secret_detectors=[Nope]"])
    assert bad.exit_code == 2 and "Nope" in bad.output


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_each_team_snapshots_its_own_rows_and_the_org_those_teams_share(tmp_path, backend):
    """Issue 57's isolation: a team's snapshot holds only its callers' rows, past its own watermark, in its own
    folder; the organisation's holds every row but those of a team that keeps its outcomes to itself. A late
    answer for a row two scopes snapshotted is recorded once."""
    from serving.auth import set_team_flags
    from tasks.core.store import late_feedback, snapshots

    params = tiny_params(tmp_path)
    with store(backend, tmp_path) as engine:
        rows = [
            completion_row(f"r{i:03d}", 100.0, user=f"u{i}", team=[None, "alpha", "beta"][i % 3]) for i in range(30)
        ]
        add_completions(engine, rows)
        set_team_flags(engine, "beta", shares_with_org=False)
        add_feedback(engine, "r001", True, 105.0, user="u1")  # alpha's, answered in time
        alpha = run_ingest(engine, params, tmp_path, 200.0, "alpha")
        beta = run_ingest(engine, params, tmp_path, 200.0, "beta")
        org = run_ingest(engine, params, tmp_path, 200.0)

        def ids(result):
            return set(pq.read_table(result.snapshot).column("completion_id").to_pylist())

        assert ids(alpha) == {f"r{i:03d}" for i in range(30) if i % 3 == 1}
        assert ids(beta) == {f"r{i:03d}" for i in range(30) if i % 3 == 2}
        assert ids(org) == {f"r{i:03d}" for i in range(30) if i % 3 != 2}  # beta shares nothing with the org
        assert alpha.snapshot.parent == tmp_path / "data" / "teams" / "alpha" / "interactions"
        assert alpha.snapshot.name.startswith("interactions-alpha-") and org.snapshot.parent.name == "interactions"
        assert (alpha.watermark, beta.watermark, org.watermark) == (29, 30, 29)  # each its own: its last row's seq

        add_completions(engine, [completion_row("r030", 300.0, user="u30", team="alpha")])
        add_feedback(engine, "r004", False, 350.0, user="u4")  # late for r004 (alpha's), in two snapshots
        again = run_ingest(engine, params, tmp_path, 400.0, "alpha")
        assert ids(again) == {"r030"} and again.late_feedback == 1
        org_again = run_ingest(engine, params, tmp_path, 400.0)
        assert ids(org_again) == {"r030"} and org_again.late_feedback == 0  # r004's, recorded already
        with engine.connect() as conn:
            assert conn.execute(sa.select(late_feedback.c.completion_id)).scalars().all() == ["r004"]
            recorded = dict(conn.execute(sa.select(snapshots.c.name, snapshots.c.team)).all())
        assert recorded[alpha.snapshot.name] == "alpha" and recorded[org.snapshot.name] is None

        # Decided rows younger than ingest.commit_grace_s, between other scopes' rows: gaps in a team's sequence,
        # not inserts that may still commit; the team takes them now.
        fresh = [completion_row(f"f{i}", 995.0, user=f"u{i}", team=["alpha", None][i % 2]) for i in range(6)]
        add_completions(engine, fresh)
        quick = params.model_copy(update={"ingest": params.ingest.model_copy(update={"feedback_timeout_s": 1.0})})
        assert ids(run_ingest(engine, quick, tmp_path, 1000.0, "alpha")) == {"f0", "f2", "f4"}


def test_a_cycle_versions_its_snapshot_in_the_snapshots_repo_and_leaves_the_checkout_clean(
    tmp_path, monkeypatch, prefect_harness, mlflow_store, tiny_model_dir
):
    """Issue 58, item 5: snapshots are versioned in a data repository of their own (paths.snapshots_repo, made on
    first use), not committed on the project's working branch: after `tabrl ingest` and a cycle run from a checkout,
    its `git status` is clean and its history has no new commit."""
    from flows.cli.main import app
    from flows.cycle import online_rl_cycle

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for cmd in (["git", "init", "-q"], ["git", "config", "user.name", "t"], ["git", "config", "user.email", "t@x"]):
        subprocess.run(cmd, cwd=checkout, check=True)
    (checkout / ".gitignore").write_text("state/\n")  # as the project's: local state is not the project's
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "add", "-A"], cwd=checkout, check=True)
    subprocess.run(["git", "commit", "-qm", "the project"], cwd=checkout, check=True)
    monkeypatch.chdir(checkout)
    paths = {"data_dir": "data", "snapshots_repo": "state/snapshots"}
    params = tiny_params(tmp_path, paths=paths, model={"base_dir": str(tiny_model_dir)})
    params = params.model_copy(update={"train": params.train.model_copy(update={"min_rows": 10**6})})
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    with Store(params.paths.database_url) as opened:
        add_completions(opened.engine, _rows(10, 0, 100.0))
        result = CliRunner().invoke(app, ["ingest", "--params", str(params_file)])
        assert result.exit_code == 0 and "committed" in result.output, result.output
        add_completions(opened.engine, _rows(10, 10, 100.0))
    report = online_rl_cycle(str(params_file), [])  # ingests and versions, then too few rows to train on
    assert report.status == "skipped" and "too few rows" in report.reason
    snapshots = checkout / "state" / "snapshots"
    versioned = sorted(p.name for p in (snapshots / "data" / "interactions").glob("*.parquet.dvc"))
    assert versioned == ["interactions-000000000001-000000000010.parquet.dvc"] + [
        "interactions-000000000011-000000000020.parquet.dvc"
    ]
    log = subprocess.run(["git", "log", "--format=%s"], cwd=snapshots, capture_output=True, text=True, check=True)
    assert log.stdout.count("ingest: snapshot") == 2
    status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True)
    assert status.stdout == ""
    history = subprocess.run(["git", "log", "--format=%s"], cwd=checkout, capture_output=True, text=True)
    assert history.stdout.split("\n")[0] == "the project"


def test_a_backlog_drains_in_snapshots_of_at_most_max_rows(tmp_path):
    """ingest.max_rows: a cycle takes the oldest decided rows up to the cap and moves the watermark there; the
    next cycles take the rest, each row once (a backlog never makes one training outgrow its timeout)."""
    params = tiny_params(tmp_path, ingest={"max_rows": 8})
    with store("sqlite", tmp_path) as engine:
        add_completions(engine, _rows(20, 0, 100.0))
        done = [run_ingest(engine, params, tmp_path, 200.0) for _ in range(3)]
        assert [(r.first_seq, r.last_seq, r.pending) for r in done] == [(1, 8, 12), (9, 16, 4), (17, 20, 0)]
        taken = [pq.read_table(r.snapshot).column("completion_id").to_pylist() for r in done]
        assert [c for part in taken for c in part] == [f"r{i:03d}" for i in range(20)]
