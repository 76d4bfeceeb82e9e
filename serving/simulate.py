"""Simulated users over HTTP: they type real code and drive the gateway exactly as an editor does.

Each user types regions of real files (typing sessions, ``tasks/sim/editor.py``): at every pause the
editor POSTs /v1/completions with the file up to the cursor as prefix and the file after the
region as suffix; the user thinks for its persona's ``think_s``, then presses Tab (POST
/v1/feedback accepted=true, the cursor jumps past the suggestion) when it is what they were about
to type, or keeps typing (silence: the ingest timeout rule turns it into a rejection). Users run
concurrently; their decisions are seeded per (user, request), whatever order requests arrive in. What the
model suggests depends on that order (the gateway's draws are shared) and so does who asks how much (one budget),
unless ``simulator.replay``: each user asks a fixed share, every request carries its own ``seed``, and with the
waiting editor a run against one arm replays exactly.

With ``simulator.client: continue`` (the default) the editor behaves as Continue does. Each pause lasts
``Session.pause`` (the persona's pace); the editor asks ``simulator.debounce_s`` into it (a shorter pause asks
nothing), keeps one request in flight per user, and aborts it when the pause ends before the answer: the client
hangs up and the gateway logs the completion as cancelled. An answer that came as the user typed on (on screen
for less than ``simulator.min_display_s``) is discarded with ``shown: false``. Only what was displayed gets an
outcome. Time is compressed: nothing sleeps the pauses; a request waits at most until the pause would end.
``simulator.client: waits`` waits for every answer and shows it (older results).

    run_simulation(base_url, regions, users, n_requests, api_keys, concurrency, seed, traffic, simulator)
        -> {arm: TypingSummary}
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import httpx

from tasks.core.config import SimulatorParams, TrafficParams
from tasks.sim.editor import Region
from tasks.sim.sessions import Session, Turn, TypingSummary, summarise_turns
from tasks.sim.users import SimUser


class SimulationError(RuntimeError):
    """The gateway refused a simulated request; the message carries its answer, `status` its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Editor:
    """One simulated user's editor: its client, key, share of the request budget, and the turns it saw."""

    client: httpx.AsyncClient
    user: SimUser
    key: str | None
    sim: SimulatorParams
    limiter: asyncio.Semaphore
    max_tokens: int | None
    seed: int | None = None  # simulator.replay: the run's seed, from which each request's own is drawn
    turns: list[Turn] = field(default_factory=list)
    arm: str = ""  # the arm the user's answers came from (sticky per user); "" before the first answer
    unattributed: list[int] = field(default_factory=list)  # turns cancelled before any answer named the arm

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    async def ask(self, request: dict, wait_s: float | None) -> tuple[dict | None, float]:
        """POST /v1/completions for the request; (its answer, seconds it took), or (None, seconds waited) when the
        user typed on first (after wait_s): the request is aborted, as Continue aborts it (the gateway sees the
        client hang up)."""
        # prefix + suffix: the gateway renders them in the serving arm's own template, whatever its family
        body = {"prompt": request["prefix"], "suffix": request["suffix"], "user": self.user.user_id}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.seed is not None:
            body["seed"] = request_seed(self.seed, self.user.user_id, len(self.turns))
        async with self.limiter:
            started = time.perf_counter()
            try:
                response = await asyncio.wait_for(
                    self.client.post("/v1/completions", json=body, headers=self.headers), wait_s
                )
            except TimeoutError:
                return None, time.perf_counter() - started
        if response.status_code != 200:
            raise SimulationError(
                f"POST /v1/completions for {self.user.user_id} answered {response.status_code}: {response.text[:300]}",
                response.status_code,
            )
        return response.json(), time.perf_counter() - started

    async def tell(self, completion_id: str, body: dict) -> None:
        async with self.limiter:
            fb = await self.client.post(
                "/v1/feedback", json={"completion_id": completion_id, **body}, headers=self.headers
            )
        if fb.status_code != 200:
            raise SimulationError(
                f"POST /v1/feedback for {completion_id} answered {fb.status_code}: {fb.text[:300]}", fb.status_code
            )

    def saw(self, turn: Turn) -> None:
        if turn.arm and not self.arm:  # the first answer names the user's arm: earlier cancelled turns were on it
            self.arm = turn.arm
            for i in self.unattributed:
                self.turns[i] = replace(self.turns[i], arm=turn.arm)
            self.unattributed.clear()
        if not turn.arm:
            self.unattributed.append(len(self.turns))
        self.turns.append(turn)

    def pause(self, session: Session) -> float | None:
        """How long the user pauses at the session's current pause (None: an editor that waits for every answer
        does not care)."""
        return None if self.sim.client == "waits" else session.pause(self.sim)

    async def turn(self, session: Session, pause: float | None) -> None:
        """One pause of a typing session (`pause`: its length) with a request, and what the user did with its
        answer."""
        request = session.request()
        wait_s = None if pause is None else pause - self.sim.debounce_s  # from the request to the next keystroke
        answer, took = await self.ask(request, wait_s)
        if answer is None:
            self.saw(session.unseen("cancelled", arm=self.arm))
            return
        arm = answer.get("tabrl", {}).get("arm", answer["model"])
        text = answer["choices"][0]["text"]
        if wait_s is not None and text.strip() and wait_s - took < self.sim.min_display_s:
            # it came as the user typed on (or after): never seen, and the editor says so
            await self.tell(answer["id"], {"shown": False})
            self.saw(session.unseen("not_shown", text, arm))
            return
        turn = session.answer(text, arm)
        if self.user.persona.think_s:
            await asyncio.sleep(self.user.persona.think_s)
        if turn.outcome == "accepted":
            await self.tell(answer["id"], {"accepted": True, "accepted_chars": len(turn.suggestion)})
        self.saw(turn)  # a rejection is the user's silence: the timeout rule's


def _budgets(n_requests: int, users: int, replay: bool) -> list[list[int]]:
    """Each user's request budget (a one-item list it counts down): one budget shared by all, spent by whoever
    asks first; with simulator.replay, a fixed share each (the first n_requests % users users one more)."""
    if not replay:
        return [[n_requests]] * users
    return [[n_requests // users + (i < n_requests % users)] for i in range(users)]


def request_seed(run_seed: int, user_id: str, k: int) -> int:
    """The `seed` of user_id's k-th request in a run (simulator.replay): the same in every replay of the run."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{user_id}:{k}".encode()).digest()[:8], "big") >> 1


async def _one_user(
    editor: _Editor,
    regions: Sequence[Region],
    budget: list[int],
    seed: int,
    traffic: TrafficParams,
    done: Callable[[], None],
    on_error: Callable[[Exception], None] | None = None,
) -> dict[str, int]:
    """Type this user's regions in order until its request budget is spent; characters typed per arm.
    With on_error, a turn the gateway failed (no answer, or an error status) is reported to it and the user goes
    on a second later instead of the simulation stopping (a soak's traffic through faults)."""
    typed: dict[str, int] = {}  # arm -> characters typed in sessions it served
    for region in regions:
        if budget[0] <= 0:
            break
        session = Session(region, editor.user, traffic, seed)
        while not session.done and budget[0] > 0:  # the budget spent, the user stops where the cursor is
            pause = editor.pause(session)
            if pause is not None and pause < editor.sim.debounce_s:
                session.type_on()  # typed on within the debounce: the editor never asked
                continue
            budget[0] -= 1
            try:
                await editor.turn(session, pause)
            except (httpx.HTTPError, SimulationError) as err:
                if on_error is None:
                    raise
                on_error(err)
                await asyncio.sleep(1.0)
            done()
        if editor.arm:
            typed[editor.arm] = typed.get(editor.arm, 0) + session.typed_chars
    return typed


async def simulate_async(
    base_url: str,
    regions: Sequence[Region],
    users: Sequence[SimUser],
    n_requests: int,
    api_keys: dict[str, str] | None,
    concurrency: int,
    seed: int,
    traffic: TrafficParams,
    simulator: SimulatorParams,
    timeout_s: float = 60.0,
    max_tokens: int | None = None,
    progress: Callable[[], None] = lambda: None,
    on_error: Callable[[Exception], None] | None = None,
    event_hooks: dict[str, list[Callable]] | None = None,
) -> tuple[list[Turn], dict[str, int]]:
    """All turns of n_requests; user i types regions i, i+U, ... (the characters typed per arm come back too).
    on_error: see _one_user; event_hooks: httpx's, on the editors' client (a soak's ledger reads every answer)."""
    if not regions or not users:
        raise ValueError("simulation needs at least one region and one user")
    budgets = _budgets(n_requests, len(users), simulator.replay)
    limiter = asyncio.Semaphore(concurrency)
    # The limiter bounds what is in flight, not the pool: a request cancelled while it waits for a pool connection
    # leaks that slot in httpcore 1.0.9 (encode/httpcore#1093), and after enough aborted requests every request
    # failed with PoolTimeout (the demo's A/B test, 96 Continue-like users, 2026-12-02). An unbounded pool never
    # makes a request wait for a connection.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(timeout_s), limits=limits, event_hooks=event_hooks
    ) as client:
        editors = [
            _Editor(
                client,
                user,
                (api_keys or {}).get(user.user_id),
                simulator,
                limiter,
                max_tokens,
                seed if simulator.replay else None,
            )
            for user in users
        ]
        per_user = await asyncio.gather(
            *[
                _one_user(editor, regions[i :: len(users)], budgets[i], seed, traffic, progress, on_error)
                for i, editor in enumerate(editors)
            ]
        )
    typed: dict[str, int] = {}
    for by_arm in per_user:
        for arm, chars in by_arm.items():
            typed[arm] = typed.get(arm, 0) + chars
    return [t for editor in editors for t in editor.turns], typed


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
    simulator: SimulatorParams,
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
            simulator,
            max_tokens=max_tokens,
            progress=progress,
        )
    )
    return summarise_by_arm(turns, typed)
