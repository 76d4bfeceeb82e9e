"""The soak's reconciliation: the ledger against the store, the snapshots against the store, the cycles and the
arms against Prefect and MLflow."""

from __future__ import annotations

from pathlib import Path

import httpx
import pyarrow.parquet as pq
import sqlalchemy as sa

from bench.soak.stack import Soak
from bench.soak.traffic import Ledger
from tasks.core.config import load_params
from tasks.core.store import CHALLENGER, CHAMPION, completions, feedback, open_store, read_arms, snapshots, watermarks
from tasks.deploy.registry import Registry


def reconcile_store(engine: sa.Engine, ledger: Ledger) -> dict[str, int]:
    """The ledger against the log store."""
    with engine.connect() as conn:
        stored = {r.id: r for r in conn.execute(sa.select(completions.c.id, completions.c.user_id, completions.c.arm))}
        fb = {r.completion_id: r for r in conn.execute(sa.select(feedback))}
        dup_c = conn.execute(
            sa.select(sa.func.count()).select_from(
                sa.select(completions.c.id).group_by(completions.c.id).having(sa.func.count() > 1).subquery()
            )
        ).scalar()
        dup_f = conn.execute(
            sa.select(sa.func.count()).select_from(
                sa.select(feedback.c.completion_id)
                .group_by(feedback.c.completion_id)
                .having(sa.func.count() > 1)
                .subquery()
            )
        ).scalar()
    lost = [i for i in ledger.completions if i not in stored]
    wrong_completion = [
        i for i, e in ledger.completions.items()
        if i in stored and (stored[i].user_id != e["user"] or stored[i].arm != e["arm"])
    ]  # fmt: skip
    lost_fb = [i for i in ledger.feedback if i not in fb]
    misattached = [i for i, e in ledger.feedback.items() if i in fb and not _same_outcome(fb[i], e)]
    misattached += [i for i in ledger.feedback if i in fb and i not in ledger.completions and i not in stored]
    return {
        "completions answered (ledger)": len(ledger.completions),
        "feedback acknowledged (ledger)": len(ledger.feedback),
        "completions in the store": len(stored),
        "completions lost": len(lost),
        "completions stored with another user or arm": len(wrong_completion),
        "feedback lost": len(lost_fb),
        "feedback misattached": len(misattached),
        "duplicated completions": int(dup_c),
        "duplicated feedback": int(dup_f),
    }


def _same_outcome(stored, entry: dict) -> bool:
    """The stored feedback says what the editor said: accepted or not, shown or not."""
    return bool(stored.accepted) == entry["accepted"] and (stored.shown is not False) == (entry["shown"] is not False)


def reconcile_snapshots(engine: sa.Engine, repo: Path, data_dir: str) -> dict[str, int]:
    """Committed snapshots against the store: disjoint ranges covering every seq up to the watermark, and every
    snapshotted id in exactly one file, inside its range."""
    with engine.connect() as conn:
        snaps = list(conn.execute(sa.select(snapshots).order_by(snapshots.c.first_seq)))
        mark = conn.execute(sa.select(sa.func.max(watermarks.c.completion_seq))).scalar() or 0
        seqs = dict(conn.execute(sa.select(completions.c.id, completions.c.seq)).all())
        top = conn.execute(sa.select(sa.func.max(completions.c.seq))).scalar() or 0
    overlaps = sum(1 for a, b in zip(snaps, snaps[1:], strict=False) if b.first_seq <= a.last_seq)
    covered = sum(s.last_seq - s.first_seq + 1 for s in snaps)
    first = snaps[0].first_seq if snaps else 1
    gaps = sum(1 for a, b in zip(snaps, snaps[1:], strict=False) if b.first_seq > a.last_seq + 1)
    where: dict[str, int] = {}
    outside = missing_files = 0
    directory = repo / data_dir / "interactions"
    for snap in snaps:
        path = directory / snap.name
        if not path.exists():
            missing_files += 1
            continue
        for cid in pq.read_table(path, columns=["completion_id"]).column("completion_id").to_pylist():
            where[cid] = where.get(cid, 0) + 1
            seq = seqs.get(cid)
            if seq is not None and not snap.first_seq <= seq <= snap.last_seq:
                outside += 1
    committed = {s.name for s in snaps}
    stray = [
        p.name
        for p in directory.glob("interactions-*.parquet")
        if p.name not in committed and ".rewarded" not in p.name
    ]
    return {
        "snapshots committed": len(snaps),
        "completions up to the watermark": sum(1 for s in seqs.values() if s <= mark),
        "completions after the watermark": sum(1 for s in seqs.values() if s > mark),
        "snapshot ranges overlapping": overlaps,
        "gaps between snapshot ranges": gaps + (1 if snaps and first > 1 else 0),
        "seqs up to the watermark not covered": max(0, mark - (first - 1) - covered) if snaps else (1 if mark else 0),
        "completion ids in two snapshots": sum(1 for n in where.values() if n > 1),
        "snapshot rows outside their range": outside,
        "committed snapshot files missing": missing_files,
        "uncommitted snapshot files left": len(stray),
        "highest seq": int(top),
    }


def cycle_runs(soak: Soak) -> list[dict]:
    """The cycle runs MLflow has (`cycle N · outcome ...`), oldest first."""
    import mlflow

    client = mlflow.MlflowClient(soak.mlflow)
    experiment = client.get_experiment_by_name(load_params(soak.params_file, []).deploy.experiment)
    runs = client.search_runs([experiment.experiment_id], max_results=5000) if experiment else []
    cycles = []
    for run in runs:
        name = run.info.run_name or ""
        if not name.startswith("cycle "):
            continue  # the base model's registration run
        outcome = name.split(" · ")[1].split(":")[0] if " · " in name else run.info.status.lower()
        end = (run.info.end_time or 0) / 1000 or None
        cycles.append(
            {
                "name": name,
                "outcome": outcome,
                "status": run.info.status,
                "start": run.info.start_time / 1000,
                "end": end,
            }
        )
    return sorted(cycles, key=lambda c: c["start"])


def aliases_and_arms(soak: Soak) -> dict[str, dict]:
    """What the champion and challenger aliases name, and what the arms table serves."""
    params = load_params(soak.params_file, [f"paths.mlflow_tracking_uri={soak.mlflow}"])
    registry = Registry(params)
    with open_store(params.paths.database_url) as engine, engine.connect() as conn:
        arms = {a.name: a.model_version for a in read_arms(conn)}
    aliases = {}
    for alias in (CHAMPION, CHALLENGER):
        version = registry.aliased(alias)
        aliases[alias] = version.label if version else None
    return {"aliases": aliases, "arms": {k: arms.get(k) for k in (CHAMPION, CHALLENGER)}}


def reconcile_cycles(soak: Soak) -> tuple[dict[str, int], dict]:
    """Every cycle ended and none overlapped another that trained; no flow run left running; aliases = arms."""
    cycles = cycle_runs(soak)
    trained = [c for c in cycles if c["outcome"] != "skipped"]
    overlapping = sum(
        1 for a, b in zip(trained, trained[1:], strict=False) if a["end"] is None or b["start"] < a["end"]
    )
    by_state = {}
    for state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED", "RUNNING", "PENDING", "CANCELLING"):
        flt = {"flow_runs": {"state": {"type": {"any_": [state]}}}}
        by_state[state] = httpx.post(f"{soak.prefect_api}/flow_runs/count", json=flt, timeout=30).json()
    outcomes: dict[str, int] = {}
    for c in cycles:
        outcomes[c["outcome"]] = outcomes.get(c["outcome"], 0) + 1
    arms = aliases_and_arms(soak)
    table = {
        "cycle runs (MLflow)": len(cycles),
        **{f"cycles {k}": v for k, v in sorted(outcomes.items())},
        "cycle runs not ended": sum(1 for c in cycles if c["status"] == "RUNNING"),
        "cycles overlapping": overlapping,
        **{f"flow runs {k.lower()}": v for k, v in by_state.items()},
        "flow runs left running": sum(by_state[k] for k in ("RUNNING", "PENDING", "CANCELLING")),
        "aliases unlike the arms table": sum(1 for k in arms["aliases"] if arms["aliases"][k] != arms["arms"][k]),
    }
    return table, {"cycles": cycles, **arms}


MUST_BE_ZERO = (
    "completions lost",
    "completions stored with another user or arm",
    "feedback lost",
    "feedback misattached",
    "duplicated completions",
    "duplicated feedback",
    "snapshot ranges overlapping",
    "gaps between snapshot ranges",
    "seqs up to the watermark not covered",
    "completion ids in two snapshots",
    "snapshot rows outside their range",
    "committed snapshot files missing",
    "cycle runs not ended",
    "cycles overlapping",
    "flow runs left running",
    "aliases unlike the arms table",
    "processes left after stop",
    "faults not injected",
    "faults not recovered from",
)
