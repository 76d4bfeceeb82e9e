"""Ingest throughput: N synthetic logged events in the log store -> one cleaned Parquet snapshot.

    python -m bench.ingest --rows 1000000                  # SQLite
    python -m bench.ingest --rows 200000 --backend postgres --postgres-url postgresql+psycopg://...

Events look like editor traffic: prompts are windows of real stdlib code (so editor context repeats
across requests, as it does for a user typing in one file), 10% abstentions, ~70% with feedback,
1% exact duplicates, 1% of users opted out, one planted secret per 1000 rows. The ingest runs in a
child process so its peak RSS is its own (the parent holds the generator's state). Prints a
table, writes bench/out/ingest.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from tasks.core.store import Store, completions, feedback, init_schema, users
from tasks.sim.corpus import stdlib_root

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = [
    "id",
    "created_at",
    "user_id",
    "arm",
    "model_version",
    "prompt",
    "prefix",
    "suffix",
    "completion",
    "token_ids",
    "logprobs",
    "temperature",
    "latency_ms",
    "abstained",
    "prompt_hash",
    "source",
]
SECRET = 'AWS_ACCESS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"'


def code_pool(max_files: int = 150) -> list[str]:
    files = sorted((stdlib_root() / "email").rglob("*.py")) + sorted((stdlib_root() / "json").rglob("*.py"))
    texts = []
    for path in files[:max_files]:
        try:
            text = path.read_text()
            if len(text) > 1000:
                texts.append(text)
        except UnicodeDecodeError:
            continue
    return texts


def events(n: int, seed: int = 0, n_users: int = 2000):
    """(completion row, feedback row or None) in seq order."""
    rng = random.Random(seed)
    pool = code_pool()
    t0 = 1_700_000_000.0
    pool = [text.splitlines(keepends=True) for text in pool]
    previous = None
    for i in range(n):
        if previous is not None and rng.random() < 0.01:
            user, prefix, suffix, middle = previous  # an exact duplicate of the last request
        else:
            # An editor window: whole lines before and after, the cursor somewhere in its line.
            user = f"user-{rng.randrange(n_users):05d}"
            lines = rng.choice(pool)
            row = rng.randrange(len(lines))
            line = lines[row]
            col = rng.randrange(len(line))
            prefix = "".join(lines[max(0, row - 20) : row]) + line[:col]
            middle = line[col:].rstrip("\n")
            suffix = "\n" + "".join(lines[row + 1 : row + 8])
            if rng.random() < 0.001:
                prefix += "\n" + SECRET + "\n"
        previous = (user, prefix, suffix, middle)
        abstained = rng.random() < 0.1
        completion = "" if abstained else middle
        prompt = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
        n_tok = 0 if abstained else rng.randint(1, 16)
        created = t0 + i * 0.01
        cid = f"cmpl-{i:09d}"
        row = (
            cid,
            created,
            user,
            "champion" if i % 2 else "challenger",
            "tabrl-completion/1",
            prompt,
            prefix,
            suffix,
            completion,
            json.dumps([rng.randrange(4096) for _ in range(n_tok)]),
            json.dumps([round(-rng.random() * 3, 4) for _ in range(n_tok)]),
            0.7,
            20.0,
            abstained,
            hashlib.sha256(f"{prompt}\0{completion}".encode()).hexdigest(),
            "bench",
        )
        fb = None
        if not abstained and rng.random() < 0.7:
            fb = (cid, True, rng.random() < 0.4, None, created + rng.uniform(0.1, 12.0), "api", user, True)
        yield row, fb


FEEDBACK_COLUMNS = [
    "completion_id",
    "matched",
    "accepted",
    "accepted_chars",
    "received_at",
    "source",
    "user_id",
    "trainable",
]


def fill(url: str, n: int, chunk: int = 20_000) -> float:
    engine = Store(url).engine
    init_schema(engine)
    start = time.perf_counter()
    batch_c, batch_f = [], []

    def flush():
        if engine.dialect.name == "postgresql":
            raw = engine.raw_connection()
            try:
                with raw.cursor() as cur:
                    with cur.copy(f"COPY completions ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                        for row in batch_c:
                            copy.write_row(row)
                    with cur.copy(f"COPY feedback ({', '.join(FEEDBACK_COLUMNS)}) FROM STDIN") as copy:
                        for row in batch_f:
                            copy.write_row(row)
                raw.commit()
            finally:
                raw.close()
        else:
            with engine.begin() as conn:
                dbapi = conn.connection.driver_connection
                dbapi.executemany(
                    f"INSERT INTO completions ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", batch_c
                )
                dbapi.executemany(
                    f"INSERT INTO feedback ({', '.join(FEEDBACK_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(FEEDBACK_COLUMNS))})",
                    batch_f,
                )
        batch_c.clear()
        batch_f.clear()

    for row, fb in events(n):
        batch_c.append(row)
        if fb:
            batch_f.append(fb)
        if len(batch_c) >= chunk:
            flush()
    flush()
    with engine.begin() as conn:
        conn.execute(
            users.insert(),
            [{"user_id": f"user-{u:05d}", "opted_out": True, "updated_at": 0.0} for u in range(0, 2000, 100)],
        )
        counts = (
            conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar_one(),
            conn.execute(sa.select(sa.func.count()).select_from(feedback)).scalar_one(),
        )
    engine.dispose()
    assert counts[0] == n, counts
    return time.perf_counter() - start


def child(url: str, out_dir: str, overrides: list[str]) -> None:
    """Runs in its own process: one ingest cycle over everything, prints its numbers as JSON."""
    from tasks.core.config import load_params
    from tasks.ingest.snapshot import run_ingest

    params = load_params(None, [f"paths.data_dir={out_dir}", *overrides], environ={})
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine = Store(url).engine
    start, cpu = time.perf_counter(), time.process_time()
    result = run_ingest(engine, params, Path(out_dir), now=2_000_000_000.0)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "rows_in": result.report["rows_in"],
                "rows_out": result.rows,
                "report": result.report,
                "late_feedback": result.late_feedback,
                "snapshot_mb": result.snapshot.stat().st_size / 2**20,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "rss_after_imports_mb": rss_before / 1024,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--backend", choices=["sqlite", "postgres"], action="append")
    ap.add_argument("--postgres-url", default=os.environ.get("TABRL_TEST_POSTGRES_URL"))
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "ingest-work")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="params override for the ingest (default per_user_cap=100000: the bench measures throughput)",
    )
    ap.add_argument("--child", nargs=2, metavar=("URL", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = ["ingest.per_user_cap=100000", *args.overrides]
    if args.child:
        child(args.child[0], args.child[1], overrides)
        return
    results = []
    for backend in args.backend or ["sqlite"]:
        run_dir = args.work / f"{backend}-{args.rows}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        run_dir.mkdir(parents=True)
        schema = None
        if backend == "sqlite":
            url = f"sqlite:///{run_dir}/log.db"
        else:
            if not args.postgres_url:
                print("postgres: skipped (set --postgres-url or TABRL_TEST_POSTGRES_URL)")
                continue
            schema = f"bench_{uuid.uuid4().hex[:8]}"
            admin = sa.create_engine(args.postgres_url)
            with admin.begin() as conn:
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
            url = f"{args.postgres_url}?options=-csearch_path%3D{schema}"
        try:
            fill_s = fill(url, args.rows)
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    url,
                    str(run_dir),
                    *sum((["--set", o] for o in args.overrides), []),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            numbers = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            if schema:
                with admin.begin() as conn:
                    conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
                admin.dispose()
        results.append(
            {
                "backend": backend,
                "rows": args.rows,
                "fill_seconds": fill_s,
                **numbers,
                "rows_per_s": args.rows / numbers["seconds"],
            }
        )
    print(
        f"{'backend':10} {'events':>9} {'ingest s':>9} {'cpu s':>7} {'rows/s':>9} {'kept':>8} "
        f"{'peak RSS MB':>12} {'(imports)':>10} {'fill s':>7}"
    )
    for r in results:
        print(
            f"{r['backend']:10} {r['rows']:>9} {r['seconds']:>9.1f} {r['cpu_seconds']:>7.1f} "
            f"{r['rows_per_s']:>9.0f} {r['rows_out']:>8} "
            f"{r['peak_rss_mb']:>12.0f} {r['rss_after_imports_mb']:>10.0f} {r['fill_seconds']:>7.1f}"
        )
    for r in results:
        print(f"{r['backend']} cleaning report: {r['report']}")
    out = ROOT / "bench" / "out" / "ingest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{os.cpu_count()} cores", "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
