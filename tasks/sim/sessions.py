"""Typing sessions: simulated users type regions (tasks.sim.editor) and answer each suggestion.

A user presses Tab iff the suggestion is what they were about to type (``is_right``, persona noise on top), and
the cursor jumps past it; otherwise they type on to the next pause. The numbers a run reports
(``TypingSummary``): suggestion rate, accept/shown, the noise-free right rate, and characters saved =
right-and-accepted characters / characters in the typed regions (Copilot's retained characters; a wrong
suggestion accepted by noise is deleted again, so it saves nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from tasks.core.config import SimulatorParams, TrafficParams
from tasks.core.outcomes import NEVER_SHOWN, OUTCOMES, Outcome
from tasks.sim.editor import Region, next_pause, request_at
from tasks.sim.users import SimUser, Summary, is_right, merge, nonblank, user_rng


def covered_chars(truth: str, suggestion: str) -> int:
    """How many characters of truth a right suggestion covers (whitespace may differ, so count non-blanks)."""
    want = nonblank(suggestion)
    seen = 0
    for i, ch in enumerate(truth):
        if not ch.isspace():
            seen += 1
            if seen == want:
                return i + 1
    return len(truth)


@dataclass(frozen=True)
class Turn:
    """One request of a typing session and what the user did with its suggestion."""

    user_id: str
    request: dict
    suggestion: str
    outcome: Outcome  # never shown (cancelled, not_shown) only over HTTP, from an editor that does not wait
    right: bool  # the noise-free rule
    saved_chars: int  # characters the cursor jumped (right and accepted), else 0
    arm: str = ""


class Session:
    """One user typing one region: ask at each pause, take the suggestion or type on."""

    def __init__(self, region: Region, user: SimUser, traffic: TrafficParams, seed: int):
        self.region, self.user, self.traffic, self.seed = region, user, traffic, seed
        self.pos = next_pause(region, region.start, traffic)

    @property
    def done(self) -> bool:
        return self.pos is None

    @property
    def typed_chars(self) -> int:
        """Characters of the region behind the cursor (all of them once the session is over)."""
        return (self.region.end if self.pos is None else self.pos) - self.region.start

    def request(self) -> dict:
        assert self.pos is not None, "the session is over"
        return request_at(self.region, self.pos, self.traffic)

    def answer(self, suggestion: str, arm: str = "") -> Turn:
        """The user's reaction to the suggestion shown at the current pause; the cursor moves on."""
        request = self.request()
        truth = request["middle"]
        shown = bool(suggestion.strip())
        right = shown and is_right(suggestion, truth, self.user.persona.min_accept_chars)
        outcome = self.user.decide(suggestion, truth, user_rng(self.user, request["sample_id"], self.seed))
        saved = covered_chars(truth, suggestion) if right and outcome == "accepted" else 0
        self.pos = next_pause(self.region, self.pos + max(saved, 1), self.traffic)
        return Turn(self.user.user_id, request, suggestion, outcome, right, saved, arm)

    def pause(self, sim: SimulatorParams) -> float:
        """How long the user pauses at the current pause before typing on (seconds): log-normal around the
        persona's pause_s, seeded by (user, position), so a run is the same however requests interleave."""
        rng = user_rng(self.user, "pause:" + self.request()["sample_id"], self.seed)
        return self.user.persona.pause_s * math.exp(sim.pause_sigma * rng.gauss(0.0, 1.0))

    def type_on(self) -> None:
        """The user types on past the current pause without seeing anything (nothing asked, or nothing shown)."""
        assert self.pos is not None, "the session is over"
        self.pos = next_pause(self.region, self.pos + 1, self.traffic)

    def unseen(self, outcome: Outcome, suggestion: str = "", arm: str = "") -> Turn:
        """The request at the current pause ended never shown (cancelled, not_shown); the user types on."""
        assert outcome in NEVER_SHOWN, f"{outcome!r} is an outcome of a shown suggestion"
        turn = Turn(self.user.user_id, self.request(), suggestion, outcome, False, 0, arm)
        self.type_on()
        return turn


def run_sessions(
    regions: Sequence[Region],
    users: Sequence[SimUser],
    suggest: Callable[[list[dict]], list[str]],
    n_requests: int,
    batch_size: int,
    seed: int,
    traffic: TrafficParams,
    progress: Callable[[int], None] = lambda n: None,
) -> tuple[list[Turn], dict[str, int]]:
    """Type regions (user i % len(users) types region i) until n_requests were asked, in batches.

    Sessions run in lockstep: each step asks ``suggest`` for the current request of up to
    batch_size open sessions. When n_requests are asked, the sessions still open stop where their
    cursor is. Returns the turns (in session order) and the characters typed per region."""
    pending = iter(enumerate(regions))
    open_: list[tuple[int, Session]] = []
    started: list[Session] = []
    turns: dict[int, list[Turn]] = {}
    asked = 0
    while asked < n_requests:
        while len(open_) < batch_size:
            nxt = next(pending, None)
            if nxt is None:
                break
            i, region = nxt
            session = Session(region, users[i % len(users)], traffic, seed)
            if not session.done:
                open_.append((i, session))
                started.append(session)
        if not open_:
            break
        batch = open_[: n_requests - asked]
        suggestions = suggest([s.request() for _, s in batch])
        for (i, session), text in zip(batch, suggestions, strict=True):
            turns.setdefault(i, []).append(session.answer(text))
        asked += len(batch)
        progress(len(batch))
        open_ = [(i, s) for i, s in open_ if not s.done]
    if not asked:
        raise ValueError("the regions produced no request")
    typed = {s.region.region_id: s.typed_chars for s in started if s.typed_chars}
    return [t for i in sorted(turns) for t in turns[i]], typed


@dataclass(frozen=True)
class TypingSummary(Summary):
    """What users of one arm saw and took in typing sessions: the simulator's counts (requests, shown,
    accepted, mean length; suggest and accept rates) plus what typing adds."""

    right: int  # shown suggestions right by the noise-free rule
    saved_chars: int
    typed_chars: int

    @property
    def right_rate(self) -> float:
        """Right per shown suggestion, without persona noise."""
        return self.right / self.shown if self.shown else 0.0

    @property
    def chars_saved(self) -> float:
        """Right-and-accepted characters per typed character."""
        return self.saved_chars / self.typed_chars if self.typed_chars else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "cancelled": self.cancelled,
            "not_shown": self.not_shown,
            "shown": self.shown,
            "accepted": self.accepted,
            "right": self.right,
            "suggest_rate": self.suggest_rate,
            "accept_rate": self.accept_rate,
            "right_rate": self.right_rate,
            "chars_saved": self.chars_saved,
            "mean_len": self.mean_len,
        }


def summarise_turns(turns: Sequence[Turn], typed_chars: int | dict[str, int]) -> TypingSummary:
    """typed_chars: the total, or per region (as ``run_sessions`` returns it)."""
    if isinstance(typed_chars, dict):
        typed_chars = sum(typed_chars.values())
    decided = [t for t in turns if t.outcome in OUTCOMES]
    shown = [t for t in decided if t.outcome != "abstained"]
    return TypingSummary(
        accepted=sum(t.outcome == "accepted" for t in turns),
        rejected=sum(t.outcome == "rejected" for t in turns),
        abstained=len(decided) - len(shown),
        cancelled=sum(t.outcome == "cancelled" for t in turns),
        not_shown=sum(t.outcome == "not_shown" for t in turns),
        accepted_chars=sum(len(t.suggestion) for t in turns if t.outcome == "accepted"),
        right=sum(t.right for t in shown),
        saved_chars=sum(t.saved_chars for t in turns),
        typed_chars=typed_chars,
        mean_len=sum(len(t.suggestion) for t in shown) / len(shown) if shown else 0.0,
    )


def merge_typing(parts: Sequence[TypingSummary]) -> TypingSummary:
    """One summary of several (arms): the simulator's merge (`users.merge`) plus what typing adds."""
    counts = merge(parts)
    never_shown = {name: sum(getattr(p, name) for p in parts) for name in NEVER_SHOWN}
    return TypingSummary(
        **({f.name: getattr(counts, f.name) for f in fields(counts)} | never_shown),
        right=sum(p.right for p in parts),
        saved_chars=sum(p.saved_chars for p in parts),
        typed_chars=sum(p.typed_chars for p in parts),
    )
