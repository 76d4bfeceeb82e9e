"""The soak's traffic: Continue-like editors in rounds, users joining and leaving, a working day's rate; and
the ledger of every answer the gateway acknowledged."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.soak.stack import ROOT, Soak
from serving.simulate import SimulationError, simulate_async
from tasks.core.config import load_params
from tasks.sim.editor import read_regions, regions_path
from tasks.sim.users import make_users

ROUND_S = 30.0  # one round of traffic: a slice of the users types at the round's rate
POPULATION = 64  # simulated users; each round a sliding slice of them types


@dataclass
class Ledger:
    """What the gateway acknowledged to the editors, kept in memory and appended to a JSONL file as it comes."""

    path: Path
    completions: dict[str, dict] = field(default_factory=dict)
    feedback: dict[str, dict] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # 'completions 503', 'feedback ConnectError', ...

    def __post_init__(self) -> None:
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 -- open for the whole run

    def close(self) -> None:
        self._file.close()

    def _write(self, kind: str, entry: dict) -> None:
        self._file.write(json.dumps({"kind": kind, **entry}) + "\n")

    async def hook(self, response: httpx.Response) -> None:
        """httpx response hook: a 200 answer to a completion or a feedback goes in the ledger."""
        request = response.request
        if response.status_code != 200 or request.method != "POST":
            return
        await response.aread()
        path = request.url.path
        if path.endswith("/v1/completions"):
            body, answer = json.loads(request.content), response.json()
            entry = {
                "id": answer["id"],
                "t": time.time(),
                "user": body.get("user"),
                "arm": answer.get("tabrl", {}).get("arm", answer["model"]),
                "shown": bool(answer["choices"][0]["text"].strip()),
            }
            self.completions[entry["id"]] = entry
            self._write("completion", entry)
        elif path.endswith("/v1/feedback"):
            body = json.loads(request.content)
            entry = {
                "id": body["completion_id"],
                "t": time.time(),
                "accepted": bool(body.get("accepted", False)),
                "shown": body.get("shown", True),
                "accepted_chars": body.get("accepted_chars"),
            }
            self.feedback[entry["id"]] = entry
            self._write("feedback", entry)

    def failed(self, err: Exception) -> None:
        if isinstance(err, SimulationError):
            kind = f"{'feedback' if 'feedback' in str(err) else 'completions'} {err.status}"
        else:
            kind = type(err).__name__
        self.failures[kind] = self.failures.get(kind, 0) + 1


def rate_at(fraction: float, low: float, peak: float) -> float:
    """Requests/s at this fraction of the run: a working day, quiet at the start and end, busiest in between,
    with a dip at lunch."""
    day = math.sin(math.pi * fraction) ** 2
    lunch = 1.0 - 0.35 * math.exp(-(((fraction - 0.5) / 0.06) ** 2))
    return low + (peak - low) * day * lunch


async def traffic(soak: Soak, ledger: Ledger, seconds: float, args, stop: threading.Event) -> int:
    params = load_params(soak.params_file, [])
    regions = read_regions(regions_path(ROOT / params.paths.data_dir, "train"))
    rng = random.Random(f"soak:{args.seed}")
    rng.shuffle(regions)
    population = make_users(POPULATION, params.simulator, prefix="soak")
    hooks = {"response": [ledger.hook]}
    n_round = 0
    while not stop.is_set() and time.time() - soak.started < seconds:
        begun = time.monotonic()
        rps = rate_at((time.time() - soak.started) / seconds, args.min_rps, args.peak_rps)
        n_users = max(2, round(rps * 2))
        first = (n_round * 5) % POPULATION  # five leave and five join each round
        users = [population[(first + i) % POPULATION] for i in range(n_users)]
        take = regions[(n_round * 97) % len(regions) :][: n_users * 4] or regions[: n_users * 4]
        await simulate_async(
            soak.gateway, take, users, max(1, round(rps * ROUND_S)), None, n_users, args.seed + n_round,
            params.traffic, params.simulator, on_error=ledger.failed, event_hooks=hooks,
        )  # fmt: skip
        n_round += 1
        await asyncio.sleep(max(0.0, ROUND_S - (time.monotonic() - begun)))
    return n_round


def probe_ok(soak: Soak, ledger: Ledger) -> bool:
    """One completion through the gateway, answered 200 (and put in the ledger like any other)."""
    body = {"prompt": "def add(a, b):\n    return ", "suffix": "\n", "user": "soak-probe"}

    async def once() -> bool:
        async with httpx.AsyncClient(timeout=10, event_hooks={"response": [ledger.hook]}) as client:
            try:
                return (await client.post(f"{soak.gateway}/v1/completions", json=body)).status_code == 200
            except httpx.HTTPError:
                return False

    return asyncio.run(once())
