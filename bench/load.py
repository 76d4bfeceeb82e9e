"""Load: N concurrent simulated editors, a fixed request count, against SQLite and PostgreSQL.

    python -m bench.load [--users 32] [--requests 2000] [--feedback-rate 0.7]
                                      [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]

The gateway runs in its own uvicorn process on loopback with auth on (one API key per editor) and
the fast in-process backend (``tests.support.harness.FastBackend``), so the numbers are the gateway's
and the store's. Each editor requests a completion, then sends feedback with probability
``--feedback-rate`` (else stays silent). Afterwards every acknowledged completion and feedback must
be in the store, with the acknowledged answer, and the counts must match exactly.

Prints a table and writes bench/out/load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tests.support.harness import bench_stores, run_load

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=32, help="concurrent editors")
    parser.add_argument("--requests", type=int, default=2000, help="completion requests in all")
    parser.add_argument("--feedback-rate", type=float, default=0.7, help="share of completions that get feedback")
    parser.add_argument(
        "--postgres", default=os.environ.get("TABRL_TEST_POSTGRES_URL"), help="also load this PostgreSQL"
    )
    args = parser.parse_args()
    results, failed = {}, False
    with bench_stores(args.postgres, "load") as stores:
        for name, url in stores.items():
            summary, problems = run_load(url, args.users, args.requests, args.feedback_rate)
            results[name] = {**summary, "problems": problems}
            failed |= bool(problems)
    print(
        f"\nLoad: {args.users} editors, {args.requests} completions, feedback rate {args.feedback_rate} "
        f"(loopback, {os.cpu_count()} cores, auth on, fast backend)"
    )
    print(
        f"{'store':<10}{'compl/s':>9}{'events/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'acked c/f':>13}"
        f"{'stored c/f':>13}{'lost':>6}"
    )
    for name, r in results.items():
        print(
            f"{name:<10}{r['completions_per_s']:>9.0f}{r['events_per_s']:>10.0f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
            f"{r['errors']:>8}{r['acked_completions']:>7}/{r['acked_feedback']:<5}"
            f"{r['stored_completions']:>7}/{r['stored_feedback']:<5}{len(r['problems']):>6}"
        )
        for problem in r["problems"]:
            print(f"  PROBLEM: {problem}")
    out = ROOT / "bench" / "out" / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": {k: v for k, v in vars(args).items() if k != "postgres"}, "results": results}, indent=2)
        + "\n"
    )
    print(f"wrote {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
