"""HTTP load from real load generators: `hey` and `wrk` (Debian packages; `make bench-tools`), and a Python
client as the fallback.

A Python (httpx) client saturates near 230 requests/s on 2 cores, far below what the servers do, so
it measures itself: the benchmarks use it only when neither tool is installed, and say so.

* ``hey_post``: N identical POSTs at concurrency C (what the issue's goals are stated in).
* ``wrk_post``: identical POSTs for a duration (microsecond percentiles; used for sequential latency).
* ``wrk_pairs``: completion + feedback pairs: each completion's id (from its response body) is sent
  back as feedback by the next request of the same wrk thread, so every feedback names a real
  completion.
* ``python_post`` / ``python_pairs``: the same with httpx, for a machine without the tools.

Every function returns a ``Load``: requests answered 200 per route, other answers, elapsed time and
latency percentiles.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


class LoadGenError(RuntimeError):
    """A load generator that failed or printed what we cannot read; the message has its output."""


@dataclass
class Load:
    tool: str
    ok: int  # 200 answers (completions, or completions + feedback for pairs)
    errors: int  # other statuses and socket errors
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    ok_by_route: dict[str, int] = field(default_factory=dict)  # "completions" / "feedback" -> 200 answers

    @property
    def per_s(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "per_s": self.per_s}


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


# ------------------------------------------------------------------------------------------------ hey


def hey_post(url: str, body: str, headers: dict[str, str], n: int, concurrency: int) -> Load:
    """`hey -n N -c C -m POST`: N identical requests over C connections (keep-alive)."""
    cmd = ["hey", "-n", str(n), "-c", str(concurrency), "-m", "POST", "-T", "application/json", "-d", body]
    for name, value in headers.items():
        cmd += ["-H", f"{name}: {value}"]
    out = _run([*cmd, url])
    rate = _grab(r"Requests/sec:\s+([\d.]+)", out)
    total = _grab(r"Total:\s+([\d.]+) secs", out)
    statuses = {int(code): int(count) for code, count in re.findall(r"\[(\d{3})\]\s+(\d+) responses", out)}
    failed = sum(int(c) for c in re.findall(r"^\s+\[(\d+)\]\s+(?!\d+ responses)", out, flags=re.M))
    ok = statuses.get(200, 0)
    if ok and abs(rate * total - sum(statuses.values())) > 0.05 * sum(statuses.values()):
        raise LoadGenError(f"hey's rate and count disagree:\n{out}")
    return Load(
        "hey",
        ok,
        sum(v for k, v in statuses.items() if k != 200) + failed,
        total,
        _grab(r"50% in ([\d.]+) secs", out) * 1000,
        _grab(r"99% in ([\d.]+) secs", out) * 1000,
        {"completions": ok},
    )


# ------------------------------------------------------------------------------------------------ wrk

_WRK_SETUP = """
local threads = {}
function setup(thread) table.insert(threads, thread) end
"""

_WRK_REPORT = """
function init(args) ok_c = 0; ok_f = 0; bad = 0; pending = {} end
function done(summary, latency, requests)
  local c, f, b = 0, 0, 0
  for _, t in ipairs(threads) do c = c + t:get("ok_c"); f = f + t:get("ok_f"); b = b + t:get("bad") end
  local e = summary.errors
  io.write(string.format(
    'TABRL {"ok_c": %d, "ok_f": %d, "bad": %d, "sock": %d, "us": %d, "p50_us": %d, "p99_us": %d}\\n',
    c, f, b, e.connect + e.read + e.write + e.timeout, summary.duration,
    latency:percentile(50), latency:percentile(99)))
end
"""
_WRK_COMMON = _WRK_SETUP + _WRK_REPORT

_WRK_POST = """
wrk.method = "POST"
wrk.body = BODY
function response(status, headers, body)
  if status == 200 then ok_c = ok_c + 1 else bad = bad + 1 end
end
"""

_WRK_PAIRS = """
local completion = nil  -- formatted on first use: the -H headers and the host are set after the script loads
function request()
  local id = table.remove(pending)
  if id then
    return wrk.format("POST", "/v1/feedback", nil, '{"completion_id":"' .. id .. '","accepted":true}')
  end
  if completion == nil then completion = wrk.format("POST", PATH, nil, BODY) end
  return completion
end
function response(status, headers, body)
  if status ~= 200 then bad = bad + 1; return end
  local id = body:match('"id":%s*"(cmpl%-%x+)"')
  if id then ok_c = ok_c + 1; table.insert(pending, id) else ok_f = ok_f + 1 end
end
"""


def _lua_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lua string literal for this ASCII text


def _wrk(url: str, script: str, headers: dict[str, str], seconds: float, concurrency: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tabrl-wrk-") as tmp:
        path = Path(tmp) / "load.lua"
        path.write_text(script)
        cmd = ["wrk", "-t", str(threads), "-c", str(concurrency), "-d", f"{seconds:g}s", "-s", str(path)]
        cmd += ["-H", "Content-Type: application/json", "--timeout", "10s"]
        for name, value in headers.items():
            cmd += ["-H", f"{name}: {value}"]
        out = _run([*cmd, url])
    found = re.search(r"^TABRL (\{.*\})$", out, flags=re.M)
    if not found:
        raise LoadGenError(f"wrk printed no summary:\n{out}")
    return json.loads(found.group(1))


def wrk_post(url: str, body: str, headers: dict[str, str], seconds: float, concurrency: int) -> Load:
    """Identical POSTs for `seconds` over `concurrency` connections (one wrk thread per 16 connections)."""
    threads = max(1, min(concurrency, 2, -(-concurrency // 16)))
    r = _wrk(url, f"BODY = {_lua_string(body)}\n" + _WRK_POST + _WRK_COMMON, headers, seconds, concurrency, threads)
    return Load(
        "wrk",
        r["ok_c"],
        r["bad"] + r["sock"],
        r["us"] / 1e6,
        r["p50_us"] / 1e3,
        r["p99_us"] / 1e3,
        {"completions": r["ok_c"]},
    )


def wrk_pairs(url: str, body: str, headers: dict[str, str], seconds: float, concurrency: int) -> Load:
    """Completion + feedback pairs for `seconds`: ok counts both; a pair is one of each."""
    base, _, path = url.partition("://")[2].partition("/")
    script = f"BODY = {_lua_string(body)}\nPATH = {_lua_string('/' + path)}\n" + _WRK_PAIRS + _WRK_COMMON
    r = _wrk(f"http://{base}/", script, headers, seconds, concurrency, 2)
    return Load(
        "wrk",
        r["ok_c"] + r["ok_f"],
        r["bad"] + r["sock"],
        r["us"] / 1e6,
        r["p50_us"] / 1e3,
        r["p99_us"] / 1e3,
        {"completions": r["ok_c"], "feedback": r["ok_f"]},
    )


_WRK_BODIES = """
local bodies, heads = {}, {}
for line in io.lines(BODIES) do
  -- a line is a JSON body, or TEAM<tab>body: that request carries X-Tabrl-Team (the -H headers too)
  local team, body = line:match("^([^\t]*)\t(.*)$")
  if team == nil then body = line end
  table.insert(bodies, body)
  table.insert(heads, team)
end
local threads = {}
function setup(thread) thread:set("id", #threads); table.insert(threads, thread) end
local cursor = nil
local function headers_of(team)
  if team == nil then return nil end
  local h = {}
  for k, v in pairs(wrk.headers) do h[k] = v end
  h["X-Tabrl-Team"] = team
  return h
end
function request()
  -- each thread walks the bodies in order from its own start: successive requests of typing sessions
  if cursor == nil then cursor = (id or 0) * math.floor(#bodies / THREADS) end
  cursor = cursor % #bodies + 1
  return wrk.format("POST", PATH, headers_of(heads[cursor]), bodies[cursor])
end
function response(status, headers, body)
  if status == 200 then ok_c = ok_c + 1 else bad = bad + 1 end
end
"""


def wrk_bodies(
    url: str,
    bodies: list[str],
    headers: dict[str, str],
    seconds: float,
    concurrency: int,
    teams: list[str] | None = None,
) -> Load:
    """POSTs of the given bodies (one JSON document each, no newlines) in order for `seconds` over `concurrency`
    connections: each wrk thread walks the list from its own start, so typing-session requests keep their order
    (their prompts share a start, which a prefix cache reuses). teams: each body's `X-Tabrl-Team` (a gateway
    without auth routes the request among that team's arms)."""
    threads = max(1, min(concurrency, 2))
    base, _, path = url.partition("://")[2].partition("/")
    lines = bodies if teams is None else [f"{team}\t{body}" for team, body in zip(teams, bodies, strict=True)]
    with tempfile.TemporaryDirectory(prefix="tabrl-bodies-") as tmp:
        listing = Path(tmp) / "bodies.jsonl"
        listing.write_text("\n".join(lines) + "\n")
        head = f"BODIES = {_lua_string(str(listing))}\nPATH = {_lua_string('/' + path)}\nTHREADS = {threads}\n"
        r = _wrk(f"http://{base}/", head + _WRK_BODIES + _WRK_REPORT, headers, seconds, concurrency, threads)
    return Load(
        "wrk",
        r["ok_c"],
        r["bad"] + r["sock"],
        r["us"] / 1e6,
        r["p50_us"] / 1e3,
        r["p99_us"] / 1e3,
        {"completions": r["ok_c"]},
    )


# --------------------------------------------------------------------------------------------- python


def python_post(url: str, body: str, headers: dict[str, str], n: int, concurrency: int) -> Load:
    return asyncio.run(_python(url, body, headers, n, concurrency, pairs=False))


def python_pairs(url: str, body: str, headers: dict[str, str], n_pairs: int, concurrency: int) -> Load:
    return asyncio.run(_python(url, body, headers, n_pairs, concurrency, pairs=True))


async def _python(url: str, body: str, headers: dict[str, str], n: int, concurrency: int, pairs: bool) -> Load:
    base, _, path = url.partition("://")[2].partition("/")
    counter = iter(range(n))
    latencies: list[float] = []
    ok = {"completions": 0, "feedback": 0}
    errors = 0
    headers = {**headers, "Content-Type": "application/json"}

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for _ in counter:
            started = time.perf_counter()
            r = await client.post("/" + path, content=body)
            latencies.append((time.perf_counter() - started) * 1000)
            if r.status_code != 200:
                errors += 1
                continue
            ok["completions"] += 1
            if pairs:
                started = time.perf_counter()
                f = await client.post("/v1/feedback", json={"completion_id": r.json()["id"], "accepted": True})
                latencies.append((time.perf_counter() - started) * 1000)
                if f.status_code == 200:
                    ok["feedback"] += 1
                else:
                    errors += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://{base}", headers=headers, timeout=30, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*[one(client) for _ in range(concurrency)])
        elapsed = time.perf_counter() - started
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return Load(
        "python", sum(ok.values()), errors, elapsed, q[49], q[98], ok if pairs else {"completions": ok["completions"]}
    )


# ---------------------------------------------------------------------------------------------- shared


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise LoadGenError(f"{cmd[0]} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _grab(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    if not found:
        raise LoadGenError(f"no {pattern!r} in the load generator's output:\n{text}")
    return float(found.group(1))
