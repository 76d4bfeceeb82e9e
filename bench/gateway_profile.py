"""Where a gateway request's time goes: CPU per request of the servers, and a py-spy profile under load.

    make bench-tools && pip install py-spy      # py-spy is for profiling only, not a tabrl dependency
    python -m bench.gateway_profile [--completions 10000] [--concurrency 32] [--seconds 10]
                                                 [--postgres URL] [--set serving.redis_url=redis://...]

For the bare server and the gateway (auth on, SQLite or PostgreSQL, `--set` overrides), back to back:
hey sends `--completions` requests at `--concurrency`; the CPU time the server's processes and hey used
(/proc and getrusage) divided by the requests answered gives ms of CPU per request, the steadiest number
on a shared machine (it does not depend on what else runs). Then py-spy samples the gateway for
`--seconds` under the same load, only while a thread holds the GIL (`--gil`: Python work, where the
event loop and the log writer compete), and the samples are summed per function: inclusive (the function
and what it calls) and self. Prints the tables, writes bench/out/gateway_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway import UNLIMITED, body
from tasks.core.procs import free_port
from tasks.core.store import Arm
from tests.support.harness import make_keys, seed_arms, start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]

SITE = re.compile(r"/[^ ;]*/(site-packages|python3\.\d+)/")
# Frames every sample of a thread passes through (process start, the event loop's run, thread bootstrap).
WRAPPERS = re.compile(
    r"^(<module>|_run_code|_run_module_as_main|main|run|Runner\.run|asyncio_run|Server\.run|serve|_serve_gateway"
    r"|Thread\.\w+|BaseEventLoop\.\w+) "
)


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of pid and its children (uvicorn workers), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [pid, *map(int, subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())]
    total = 0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def hey(url: str, payload: str, headers: dict[str, str], n: int, c: int) -> tuple[int, float, float]:
    """(requests answered 200, requests/s, hey's own CPU seconds)."""
    cmd = ["hey", "-n", str(n), "-c", str(c), "-m", "POST", "-T", "application/json", "-d", payload]
    for name, value in headers.items():
        cmd += ["-H", f"{name}: {value}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    ok = sum(int(m) for m in re.findall(r"\[200\]\s+(\d+) responses", out))
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return ok, rate, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_per_request(proc, url: str, payload: str, headers: dict[str, str], args) -> dict:
    hey(url, payload, headers, 500, 8)  # warm up: caches, connections, the first group commits
    start = tree_cpu_s(proc.pid)
    ok, rate, hey_cpu = hey(url, payload, headers, args.completions, args.concurrency)
    server = tree_cpu_s(proc.pid) - start
    return {"ok": ok, "per_s": rate, "server_cpu_ms": 1000 * server / ok, "hey_cpu_ms": 1000 * hey_cpu / ok}


def profile(pid: int, url: str, payload: str, headers: dict[str, str], args) -> dict:
    """py-spy (GIL holders only) for args.seconds while hey keeps the load on; samples per function."""
    with tempfile.TemporaryDirectory(prefix="tabrl-profile-") as tmp:
        out = Path(tmp) / "stacks.txt"
        spy = subprocess.Popen(
            [args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--gil", "--threads", "--nonblocking"]
            + ["-r", "200", "-d", str(args.seconds), "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and spy.poll() is None:
            hey(url, payload, headers, args.completions // 4, args.concurrency)
        spy.wait()
        return summarise(out.read_text())


def summarise(raw: str) -> dict:
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        if frames and frames[0].startswith("thread"):
            threads[re.sub(r"\(\d+\)", "", frames[0])] += n
            frames = frames[1:]
        names = [SITE.sub("", re.sub(r":\d+\)$", ")", f)).replace(str(ROOT) + "/", "") for f in frames]
        for name in set(names):
            if not WRAPPERS.match(name):
                inclusive[name] += n
        if names:
            own[names[-1]] += n
    share = {k: round(v / total, 4) for k, v in threads.most_common()}
    return {
        "samples": total,
        "threads": share,
        "inclusive": [(name, round(n / total, 4)) for name, n in inclusive.most_common(60)],
        "self": [(name, round(n / total, 4)) for name, n in own.most_common(25)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=10000, help="requests of each hey run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=10, help="py-spy sampling time")
    parser.add_argument("--postgres", default=None, help="profile the gateway on this PostgreSQL (default: SQLite)")
    parser.add_argument("--set", action="append", default=[], help="gateway params override, e.g. serving.x=y")
    parser.add_argument(
        "--py-spy", default=shutil.which("py-spy") or "", help="py-spy executable (profile skipped if none)"
    )
    args = parser.parse_args()
    if not shutil.which("hey"):
        sys.exit("hey is not installed: make bench-tools")
    payload = body(80)
    results: dict = {}
    port = free_port()
    bare = start_process("bare", port, timeout_s=120)
    try:
        results["bare"] = cpu_per_request(bare, f"http://127.0.0.1:{port}/v1/completions", payload, {}, args)
    finally:
        stop_process(bare)
    with tempfile.TemporaryDirectory(prefix="tabrl-profile-") as tmp:
        if args.postgres:
            from tests.support.harness import throwaway_schema

            store = throwaway_schema(args.postgres)
            db_url = store.__enter__()
        else:
            store, db_url = None, f"sqlite:///{tmp}/profile.db"
        try:
            seed_arms(db_url, [Arm("champion", "fast/1", "fast", "embedded", 1.0)])
            (_, key), *_ = make_keys(db_url, 1, prefix="profile")
            headers = {"Authorization": f"Bearer {key}"}
            port = free_port()
            sets = [a for o in [*UNLIMITED, *args.set] for a in ("--set", o)]
            gateway = start_process("gateway", port, "--db", db_url, *sets, timeout_s=120)
            url = f"http://127.0.0.1:{port}/v1/completions"
            try:
                results["gateway"] = cpu_per_request(gateway, url, payload, headers, args)
                if args.py_spy:
                    results["profile"] = profile(gateway.pid, url, payload, headers, args)
            finally:
                stop_process(gateway)
        finally:
            if store is not None:
                store.__exit__(None, None, None)
    store_name = "PostgreSQL" if args.postgres else "SQLite"
    print(f"\nCPU per request (hey c={args.concurrency}, {args.completions} requests; store {store_name})")
    print(f"{'server':<9}{'req/s':>8}{'server ms':>11}{'hey ms':>8}")
    for name in ("bare", "gateway"):
        r = results[name]
        print(f"{name:<9}{r['per_s']:>8.0f}{r['server_cpu_ms']:>11.3f}{r['hey_cpu_ms']:>8.3f}")
    if "profile" in results:
        p = results["profile"]
        print(f"\nGateway under load, py-spy --gil ({p['samples']} samples): threads {p['threads']}")
        print("inclusive (share of GIL-held samples):")
        for name, share in p["inclusive"][:40]:
            print(f"  {share:6.1%}  {name}")
        print("self:")
        for name, share in p["self"][:15]:
            print(f"  {share:6.1%}  {name}")
    else:
        print("(py-spy not found: pip install py-spy, or pass --py-spy PATH, for the profile)")
    out = ROOT / "bench" / "out" / "gateway_profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": {k: v for k, v in vars(args).items() if k != "postgres"}, **results}, indent=2) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
