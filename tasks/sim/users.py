"""Simulated users: they replay held-out FIM samples and press Tab only on what they meant to type.

A simulated user sits at the cursor of a held-out sample, asks for a completion, and accepts iff
the suggestion, whitespace-normalised, is a prefix of the true middle covering at least K
non-blank characters (K is the persona's ``min_accept_chars``, capped by the middle's own length).
An empty suggestion is "nothing shown". Personas add noise: a small chance of taking a wrong
suggestion, or of ignoring a right one. Everything is seeded.

In-process (``decide``) for evaluation; over HTTP via the gateway (``tabrl simulate``) like an editor.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.core.config import Persona, SimulatorParams
from tasks.core.outcomes import ArmCounts

_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Collapse whitespace runs to one space and strip the ends."""
    return _WS.sub(" ", text).strip()


def nonblank(text: str) -> int:
    return sum(1 for ch in text if not ch.isspace())


def is_right(suggestion: str, middle: str, min_chars: int) -> bool:
    """The noise-free rule: a normalised prefix of the middle covering enough non-blank characters."""
    shown, truth = normalise(suggestion), normalise(middle)
    if not shown or not truth.startswith(shown):
        return False
    return nonblank(shown) >= min(min_chars, nonblank(truth))


def right_if_cut(suggestion: str, middle: str, min_chars: int) -> bool:
    """Would the suggestion be right if it stopped at its best point (its longest prefix that is right)?

    A diagnostic of where a model fails: knowing what comes next but not when to stop."""
    common = os.path.commonprefix([normalise(suggestion), normalise(middle)])
    return bool(common.strip()) and is_right(common, middle, min_chars)


@dataclass(frozen=True)
class SimUser:
    user_id: str
    persona: Persona

    def decide(self, suggestion: str, middle: str, rng: random.Random) -> str:
        """'accepted' | 'rejected' | 'abstained' for one shown suggestion."""
        if not suggestion.strip():
            return "abstained"
        right = is_right(suggestion, middle, self.persona.min_accept_chars)
        if right:
            return "rejected" if rng.random() < self.persona.p_ignore_right else "accepted"
        return "accepted" if rng.random() < self.persona.p_accept_wrong else "rejected"


def make_users(n: int, params: SimulatorParams, prefix: str = "sim") -> list[SimUser]:
    """n users with personas drawn by weight from the simulator seed."""
    rng = random.Random(f"users:{params.seed}")
    weights = [p.weight for p in params.personas]
    return [SimUser(f"{prefix}-{i:04d}", rng.choices(params.personas, weights)[0]) for i in range(n)]


def user_rng(user: SimUser, sample_id: str, seed: int) -> random.Random:
    """Noise for one (user, sample) pair: the same decision however requests interleave."""
    digest = hashlib.sha256(f"{seed}:{user.user_id}:{sample_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True, kw_only=True)
class Summary(ArmCounts):
    """Outcome counts of simulated or logged requests, with the mean length of what was shown."""

    mean_len: float  # characters per shown suggestion


def merge(parts: Sequence[Summary]) -> Summary:
    """One summary of several (arms, chunks); mean length weighted by shown suggestions."""
    shown = sum(p.shown for p in parts)
    return Summary(
        accepted=sum(p.accepted for p in parts),
        rejected=sum(p.rejected for p in parts),
        abstained=sum(p.abstained for p in parts),
        accepted_chars=sum(p.accepted_chars for p in parts),
        mean_len=sum(p.mean_len * p.shown for p in parts) / shown if shown else 0.0,
    )


def summarise(outcomes: Sequence[str], suggestions: Sequence[str]) -> Summary:
    """Counts of outcomes[i] for suggestions[i]; an accepted suggestion is taken whole."""
    shown = [s for s, o in zip(suggestions, outcomes, strict=True) if o != "abstained"]
    accepted = [s for s, o in zip(suggestions, outcomes, strict=True) if o == "accepted"]
    return Summary(
        accepted=len(accepted),
        rejected=len(shown) - len(accepted),
        abstained=len(outcomes) - len(shown),
        accepted_chars=sum(map(len, accepted)),
        mean_len=sum(map(len, shown)) / len(shown) if shown else 0.0,
    )


def replay(samples: Sequence[dict], suggestions: Sequence[str], users: Sequence[SimUser], seed: int) -> list[str]:
    """Outcomes of suggestions[i] for samples[i], shown to users round-robin."""
    outcomes = []
    for i, (sample, suggestion) in enumerate(zip(samples, suggestions, strict=True)):
        user = users[i % len(users)]
        outcomes.append(user.decide(suggestion, sample["middle"], user_rng(user, sample["sample_id"], seed)))
    return outcomes
