"""Gateway overhead: the gateway vs a bare server answering from the same instant backend, in one run.

    make bench-tools     # hey + wrk (Debian packages); without them a Python client stands in, with a warning
    python -m bench.gateway [--seconds 8] [--completions 20000] [--concurrency 32]
                                         [--postgres postgresql+psycopg://postgres@127.0.0.1:5432/test]
                                         [--redis redis://127.0.0.1:6379/0] [--workers 1 2]

Every server is a uvicorn subprocess on loopback (`python -m tests.support.harness`) answered by the same
`FastBackend` (a fixed 8-token Generation, at once), so the difference is what the gateway adds: auth,
rate limits, parsing, routing, metrics and the durable commit of every row before its answer.

Per server, back to back:

* sequential (wrk, 1 connection, `--seconds`): p50 / p99, and the gateway's added p50 over the bare one;
* completions at concurrency C (hey, `--completions` requests): logged completions/s, p50, p99, and
  gateway / bare as a ratio;
* completion + feedback pairs at concurrency C (wrk, `--seconds`): logged events/s and the ratio.

After each gateway the store is counted: it must hold exactly the completions and feedback that were
answered 200 (the rate is of logged rows, not of answers). `--workers 1 2` adds replicas on the last
store (PostgreSQL when given) with the rate limits in Redis: the same completions load against
`N` worker processes behind one port. The load generator shares the machine's cores with the
servers, as on a laptop: compare the ratios within one run. Prints a table and writes
bench/out/gateway.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import sqlalchemy as sa

from bench import loadgen
from tasks.core.fim import QWEN
from tasks.core.procs import free_port
from tasks.core.store import Arm, Store, completions, feedback
from tests.support.harness import bench_stores, make_keys, seed_arms, start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]

PROMPT = QWEN.render("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")
UNLIMITED = ["serving.rate_limit_per_minute=100000000", "serving.rate_limit_per_key_per_minute=100000000"]


def body(prompt_chars: int) -> str:
    prefix = "def add(a, b):\n    "
    if prompt_chars > len(PROMPT):  # editor context before the cursor, as a real editor sends it
        prefix = "# context line of the file being edited\n" * ((prompt_chars - len(PROMPT)) // 40 + 1) + prefix
    return json.dumps({"prompt": QWEN.render(prefix, "\n\nprint(add(1, 2))\n"), "max_tokens": 8})


def measure(url: str, payload: str, headers: dict[str, str], args) -> dict:
    """Sequential latency, completions at concurrency, and completion+feedback pairs, against one server."""
    completions_url = f"{url}/v1/completions"
    if loadgen.have("wrk"):
        seq = loadgen.wrk_post(completions_url, payload, headers, args.seconds, 1)
    elif loadgen.have("hey"):
        seq = loadgen.hey_post(completions_url, payload, headers, args.completions // 10, 1)
    else:
        seq = loadgen.python_post(completions_url, payload, headers, args.completions // 20, 1)
    if loadgen.have("hey"):
        conc = loadgen.hey_post(completions_url, payload, headers, args.completions, args.concurrency)
    elif loadgen.have("wrk"):
        conc = loadgen.wrk_post(completions_url, payload, headers, args.seconds, args.concurrency)
    else:
        conc = loadgen.python_post(completions_url, payload, headers, args.completions // 10, args.concurrency)
    if loadgen.have("wrk"):
        pairs = loadgen.wrk_pairs(completions_url, payload, headers, args.seconds, args.concurrency)
    else:
        pairs = loadgen.python_pairs(completions_url, payload, headers, args.completions // 20, args.concurrency)
    return {"sequential": seq.as_dict(), "concurrent": conc.as_dict(), "pairs": pairs.as_dict()}


def fsync_ms(directory: str, n: int = 200) -> float:
    """p50 of writing 4 KiB and fdatasync-ing it in directory: the least one durable commit costs on this disk
    now (SQLite's WAL and PostgreSQL's log are flushed the same way), for reading the sequential latency."""
    path = Path(directory) / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    times = []
    try:
        for _ in range(n):
            os.write(fd, b"x" * 4096)
            started = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    return sorted(times)[n // 2]


def stored(db_url: str) -> tuple[int, int]:
    engine = Store(db_url).engine
    try:
        with engine.connect() as conn:
            n_c = conn.execute(sa.select(sa.func.count()).select_from(completions)).scalar_one()
            n_f = conn.execute(sa.select(sa.func.count()).select_from(feedback)).scalar_one()
    finally:
        engine.dispose()
    return n_c, n_f


def clear(db_url: str) -> None:
    engine = Store(db_url).engine
    try:
        with engine.begin() as conn:
            conn.execute(feedback.delete())
            conn.execute(completions.delete())
    finally:
        engine.dispose()


def gateway_run(db_url: str, key: str, payload: str, args, overrides: list[str], workers: int = 1) -> dict:
    clear(db_url)
    disk = fsync_ms(tempfile.gettempdir())
    port = free_port()
    extra = [a for o in [*UNLIMITED, *overrides] for a in ("--set", o)]
    proc = start_process("gateway", port, "--db", db_url, "--workers", str(workers), *extra, timeout_s=120)
    try:
        result = measure(f"http://127.0.0.1:{port}", payload, {"Authorization": f"Bearer {key}"}, args)
    finally:
        stop_process(proc)
    n_c, n_f = stored(db_url)
    acked_c = sum(result[k]["ok_by_route"].get("completions", 0) for k in ("sequential", "concurrent", "pairs"))
    acked_f = result["pairs"]["ok_by_route"].get("feedback", 0)
    result["stored"] = {"completions": n_c, "feedback": n_f, "acked_completions": acked_c, "acked_feedback": acked_f}
    # Every acknowledged row is stored; a wrk run ends with up to `concurrency` requests in flight, whose rows
    # may be committed with the answer never read (1 for the sequential run).
    in_flight = 1 + args.concurrency if loadgen.have("wrk") else 0
    result["stored_matches"] = acked_c <= n_c <= acked_c + in_flight and acked_f <= n_f <= acked_f + args.concurrency
    result["fsync_p50_ms"] = (disk + fsync_ms(tempfile.gettempdir())) / 2  # before and after the run
    return result


def replicas_run(db_url: str, key: str, payload: str, args) -> dict:
    """The same completions load against 1..N worker processes behind one port (limits in Redis)."""
    out = {}
    for n in args.workers:
        clear(db_url)
        port = free_port()
        extra = [a for o in [*UNLIMITED, f"serving.redis_url={args.redis}"] for a in ("--set", o)]
        proc = start_process("gateway", port, "--db", db_url, "--workers", str(n), *extra, timeout_s=120)
        try:
            load = loadgen.hey_post(
                f"http://127.0.0.1:{port}/v1/completions",
                payload,
                {"Authorization": f"Bearer {key}"},
                args.completions,
                args.concurrency,
            )
        finally:
            stop_process(proc)
        n_c, _ = stored(db_url)
        out[str(n)] = {**load.as_dict(), "stored": n_c, "stored_matches": n_c == load.ok}
    return out


def run(args) -> dict:
    payload = body(args.prompt_chars)
    results: dict = {}
    port = free_port()
    bare = start_process("bare", port, timeout_s=120)
    try:
        results["bare"] = measure(f"http://127.0.0.1:{port}", payload, {}, args)
    finally:
        stop_process(bare)
    with bench_stores(args.postgres, "bench") as stores:
        for name, db_url in stores.items():
            seed_arms(db_url, [Arm("champion", "fast/1", "fast", "embedded", 1.0)])
            (_, key), *_ = make_keys(db_url, 1, prefix="bench")
            results[name] = gateway_run(db_url, key, payload, args, [])
        if args.workers:
            name = "postgres" if "postgres" in stores else "sqlite"
            (_, key), *_ = make_keys(stores[name], 1, prefix="bench-replicas")
            results[f"replicas ({name}, redis limits)"] = replicas_run(stores[name], key, payload, args)
    return results


def machine() -> dict:
    load1, load5, _ = os.getloadavg()
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True).stdout
    return {
        "cores": os.cpu_count(),
        "cpu": cpu.partition(":")[2].strip(),
        "load_avg_1m_before": round(load1, 2),
        "load_avg_5m_before": round(load5, 2),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def print_table(results: dict, args) -> None:
    bare = results["bare"]
    print(
        f"\nGateway vs bare server (loopback, {os.cpu_count()} cores shared with the load generator; "
        f"sequential: {bare['sequential']['tool']} 1 connection; concurrent: {bare['concurrent']['tool']} "
        f"c={args.concurrency}; pairs: {bare['pairs']['tool']} c={args.concurrency}; prompt {args.prompt_chars} chars)"
    )
    head = (
        f"{'server':<9}{'c=1 p50':>8}{'p99':>7}{'added':>7}{'fsync':>7}{'c=32/s':>8}{'p50':>7}{'p99':>7}{'ratio':>7}"
        f"{'pairs ev/s':>11}{'ratio':>7}{'stored=acked':>13}"
    )
    print(head.replace("c=32", f"c={args.concurrency}"))
    for name in [n for n in results if not n.startswith("replicas")]:
        r = results[name]
        seq, conc, pairs = r["sequential"], r["concurrent"], r["pairs"]
        added = seq["p50_ms"] - bare["sequential"]["p50_ms"]
        print(
            f"{name:<9}{seq['p50_ms']:>8.2f}{seq['p99_ms']:>7.2f}{added if name != 'bare' else 0:>7.2f}"
            f"{r.get('fsync_p50_ms', 0):>7.2f}{conc['per_s']:>8.0f}{conc['p50_ms']:>7.1f}{conc['p99_ms']:>7.1f}"
            f"{conc['per_s'] / bare['concurrent']['per_s']:>7.2f}"
            f"{pairs['per_s']:>11.0f}{pairs['per_s'] / bare['pairs']['per_s']:>7.2f}"
            f"{str(r.get('stored_matches', '-')):>13}"
        )
    for name in [n for n in results if n.startswith("replicas")]:
        r = results[name]
        one = r[str(min(int(k) for k in r))]["per_s"]
        print(f"\n{name}: hey c={args.concurrency}, {args.completions} completions")
        print(f"{'workers':<9}{'compl/s':>8}{'p50':>7}{'p99':>7}{'vs 1':>7}{'errors':>8}{'stored=acked':>13}")
        for n, w in r.items():
            print(
                f"{n:<9}{w['per_s']:>8.0f}{w['p50_ms']:>7.1f}{w['p99_ms']:>7.1f}{w['per_s'] / one:>7.2f}"
                f"{w['errors']:>8}{str(w['stored_matches']):>13}"
            )
    print(
        "c=1: ms per request, one connection; added: gateway p50 - bare p50; fsync: p50 of one 4 KiB fdatasync on "
        "this disk during the run (the least a durable commit costs). c=N/s: completions answered 200 per second "
        "(every one logged); ratio: gateway / bare. pairs ev/s: completions + feedbacks per second."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each wrk run (sequential, pairs)")
    parser.add_argument("--completions", type=int, default=20000, help="requests of each hey run at concurrency")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight at once")
    parser.add_argument("--prompt-chars", type=int, default=len(PROMPT), help="size of the FIM prompt sent")
    parser.add_argument(
        "--postgres", default=os.environ.get("TABRL_TEST_POSTGRES_URL"), help="also bench this PostgreSQL"
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="rate limits of the replicas run")
    parser.add_argument("--workers", type=int, nargs="*", default=[], help="replicas run: worker counts, e.g. 1 2")
    args = parser.parse_args()
    missing = [tool for tool in ("hey", "wrk") if not loadgen.have(tool)]
    if missing:
        warnings.warn(
            f"{' and '.join(missing)} not installed (`make bench-tools`): a Python client stands in, and it "
            "saturates near 230 requests/s on 2 cores, so the numbers it gives measure the client",
            stacklevel=1,
        )
    info = machine()
    results = run(args)
    print_table(results, args)
    out = ROOT / "bench" / "out" / "gateway.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "postgres"}, "machine": info, **results}, indent=2
        )
        + "\n"
    )
    print(f"wrote {out}")
    checks = [r["stored_matches"] for name, r in results.items() if name not in ("bare",) and "stored_matches" in r]
    checks += [w["stored_matches"] for name, r in results.items() if name.startswith("replicas") for w in r.values()]
    if not all(checks):
        sys.exit("the store does not hold exactly the acknowledged rows (see stored in the JSON)")


if __name__ == "__main__":
    main()
