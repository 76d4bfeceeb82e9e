"""Simulated users over HTTP: they drive the gateway exactly as an editor does.

Each user replays held-out FIM samples one at a time: POST /v1/completions at the cursor, think for
its persona's ``think_s``, then press Tab (POST /v1/feedback accepted=true) or stay silent (the
ingest timeout rule turns silence into a rejection). Users run concurrently; their decisions are
seeded per (user, sample), so a run is reproducible however requests interleave.

    run_simulation(base_url, samples, users, n_requests, api_keys, concurrency, seed) -> {arm: Summary}
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Sequence

import httpx

from serving.simulator import SimUser, Summary, summarise, user_rng
from tasks.fim import build_prompt


class SimulationError(RuntimeError):
    """The gateway refused a simulated request; the message carries its answer."""


@dataclass(frozen=True)
class Interaction:
    user_id: str
    arm: str
    completion_id: str
    suggestion: str
    outcome: str  # accepted | rejected | abstained


async def _one_user(client: httpx.AsyncClient, user: SimUser, samples: Sequence[dict], count: int, offset: int,
                    key: str | None, seed: int, limiter: asyncio.Semaphore, max_tokens: int | None,
                    done: Callable[[], None]) -> list[Interaction]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    results = []
    for i in range(count):
        sample = samples[(offset + i) % len(samples)]
        body = {"prompt": build_prompt(sample["prefix"], sample["suffix"]), "user": user.user_id}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        async with limiter:
            response = await client.post("/v1/completions", json=body, headers=headers)
        if response.status_code != 200:
            raise SimulationError(f"POST /v1/completions for {user.user_id} answered {response.status_code}: {response.text[:300]}")
        answer = response.json()
        suggestion = answer["choices"][0]["text"]
        outcome = user.decide(suggestion, sample["middle"], user_rng(user, sample["sample_id"], seed))
        if user.persona.think_s:
            await asyncio.sleep(user.persona.think_s)
        if outcome == "accepted":
            async with limiter:
                fb = await client.post("/v1/feedback", json={"completion_id": answer["id"], "accepted": True,
                                                              "accepted_chars": len(suggestion)}, headers=headers)
            if fb.status_code != 200:
                raise SimulationError(f"POST /v1/feedback for {answer['id']} answered {fb.status_code}: {fb.text[:300]}")
        results.append(Interaction(user.user_id, answer.get("tabrl", {}).get("arm", answer["model"]), answer["id"],
                                   suggestion, outcome))
        done()
    return results


async def simulate_async(base_url: str, samples: Sequence[dict], users: Sequence[SimUser], n_requests: int,
                         api_keys: dict[str, str] | None, concurrency: int, seed: int, timeout_s: float = 60.0,
                         max_tokens: int | None = None, progress: Callable[[], None] = lambda: None) -> list[Interaction]:
    """All interactions of n_requests spread round-robin over users (each user's requests in order)."""
    if not samples or not users:
        raise ValueError("simulation needs at least one sample and one user")
    counts = [n_requests // len(users) + (1 if i < n_requests % len(users) else 0) for i in range(len(users))]
    limiter = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        per_user = await asyncio.gather(*[
            _one_user(client, user, samples, count, offset=i * 7919, key=(api_keys or {}).get(user.user_id), seed=seed,
                      limiter=limiter, max_tokens=max_tokens, done=progress)
            for i, (user, count) in enumerate(zip(users, counts)) if count
        ])
    return [x for xs in per_user for x in xs]


def summarise_by_arm(interactions: Sequence[Interaction]) -> dict[str, Summary]:
    arms = sorted({x.arm for x in interactions})
    return {arm: summarise([x.outcome for x in interactions if x.arm == arm],
                           [x.suggestion for x in interactions if x.arm == arm]) for arm in arms}


def run_simulation(base_url: str, samples: Sequence[dict], users: Sequence[SimUser], n_requests: int,
                   api_keys: dict[str, str] | None, concurrency: int, seed: int, max_tokens: int | None = None,
                   progress: Callable[[], None] = lambda: None) -> dict[str, Summary]:
    """Drive the gateway at base_url like editors would; per-arm summary of what users saw and took."""
    interactions = asyncio.run(simulate_async(base_url, samples, users, n_requests, api_keys, concurrency, seed,
                                              max_tokens=max_tokens, progress=progress))
    return summarise_by_arm(interactions)
