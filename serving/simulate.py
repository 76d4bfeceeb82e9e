"""Simulated users over HTTP: they type real code and drive the gateway exactly as an editor does.

Each user types regions of real files (typing sessions, ``tasks/sim/editor.py``): at every pause the
editor POSTs /v1/completions with the file up to the cursor as prefix and the file after the
region as suffix; the user thinks for its persona's ``think_s``, then presses Tab (POST
/v1/feedback accepted=true, the cursor jumps past the suggestion) when it is what they were about
to type, or keeps typing (silence: the ingest timeout rule turns it into a rejection). Users run
concurrently; their decisions are seeded per (user, request), so a run is reproducible however
requests interleave.

    run_simulation(base_url, regions, users, n_requests, api_keys, concurrency, seed, traffic) -> {arm: TypingSummary}
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import httpx

from tasks.core.config import TrafficParams
from tasks.sim.editor import Region
from tasks.sim.sessions import Session, Turn, TypingSummary, summarise_turns
from tasks.sim.users import SimUser


class SimulationError(RuntimeError):
    """The gateway refused a simulated request; the message carries its answer."""


async def _one_user(
    client: httpx.AsyncClient,
    user: SimUser,
    regions: Sequence[Region],
    budget: list[int],
    key: str | None,
    seed: int,
    traffic: TrafficParams,
    limiter: asyncio.Semaphore,
    max_tokens: int | None,
    done: Callable[[], None],
) -> tuple[list[Turn], dict[str, int]]:
    """Type this user's regions in order until the shared request budget is spent."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    turns: list[Turn] = []
    typed: dict[str, int] = {}  # arm -> characters typed in sessions it served
    for region in regions:
        if budget[0] <= 0:
            break
        session = Session(region, user, traffic, seed)
        arm = ""
        while not session.done and budget[0] > 0:  # the budget spent, the user stops where the cursor is
            budget[0] -= 1
            request = session.request()
            # prefix + suffix: the gateway renders them in the serving arm's own template, whatever its family
            body = {"prompt": request["prefix"], "suffix": request["suffix"], "user": user.user_id}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            async with limiter:
                response = await client.post("/v1/completions", json=body, headers=headers)
            if response.status_code != 200:
                raise SimulationError(
                    f"POST /v1/completions for {user.user_id} answered {response.status_code}: {response.text[:300]}"
                )
            answer = response.json()
            arm = answer.get("tabrl", {}).get("arm", answer["model"])
            turn = session.answer(answer["choices"][0]["text"], arm)
            if user.persona.think_s:
                await asyncio.sleep(user.persona.think_s)
            if turn.outcome == "accepted":
                async with limiter:
                    fb = await client.post(
                        "/v1/feedback",
                        json={"completion_id": answer["id"], "accepted": True, "accepted_chars": len(turn.suggestion)},
                        headers=headers,
                    )
                if fb.status_code != 200:
                    raise SimulationError(
                        f"POST /v1/feedback for {answer['id']} answered {fb.status_code}: {fb.text[:300]}"
                    )
            turns.append(turn)
            done()
        if arm:
            typed[arm] = typed.get(arm, 0) + session.typed_chars
    return turns, typed


async def simulate_async(
    base_url: str,
    regions: Sequence[Region],
    users: Sequence[SimUser],
    n_requests: int,
    api_keys: dict[str, str] | None,
    concurrency: int,
    seed: int,
    traffic: TrafficParams,
    timeout_s: float = 60.0,
    max_tokens: int | None = None,
    progress: Callable[[], None] = lambda: None,
) -> tuple[list[Turn], dict[str, int]]:
    """All turns of n_requests; user i types regions i, i+U, ... (the characters typed per arm come back too)."""
    if not regions or not users:
        raise ValueError("simulation needs at least one region and one user")
    budget = [n_requests]
    limiter = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        per_user = await asyncio.gather(
            *[
                _one_user(
                    client,
                    user,
                    regions[i :: len(users)],
                    budget,
                    (api_keys or {}).get(user.user_id),
                    seed,
                    traffic,
                    limiter,
                    max_tokens,
                    progress,
                )
                for i, user in enumerate(users)
            ]
        )
    typed: dict[str, int] = {}
    for _, by_arm in per_user:
        for arm, chars in by_arm.items():
            typed[arm] = typed.get(arm, 0) + chars
    return [t for turns, _ in per_user for t in turns], typed


def summarise_by_arm(turns: Sequence[Turn], typed: dict[str, int]) -> dict[str, TypingSummary]:
    arms = sorted({t.arm for t in turns})
    return {arm: summarise_turns([t for t in turns if t.arm == arm], typed.get(arm, 0)) for arm in arms}


def run_simulation(
    base_url: str,
    regions: Sequence[Region],
    users: Sequence[SimUser],
    n_requests: int,
    api_keys: dict[str, str] | None,
    concurrency: int,
    seed: int,
    traffic: TrafficParams,
    max_tokens: int | None = None,
    progress: Callable[[], None] = lambda: None,
) -> dict[str, TypingSummary]:
    """Drive the gateway at base_url like editors would; per-arm summary of what users saw and took."""
    turns, typed = asyncio.run(
        simulate_async(
            base_url,
            regions,
            users,
            n_requests,
            api_keys,
            concurrency,
            seed,
            traffic,
            max_tokens=max_tokens,
            progress=progress,
        )
    )
    return summarise_by_arm(turns, typed)
