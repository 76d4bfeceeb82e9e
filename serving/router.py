"""The A/B router: which arm serves a user, read live from the store.

Assignment is sticky: a user's point ``u = sha256(salt:user) / 2^64`` in [0, 1) falls in one arm's
slice of the cumulative shares (arms ordered by name), so the same user meets the same arm on
every request until the arms or the salt change. Arms are re-read from the store after
``serving.config_ttl_s`` seconds, so `tabrl arms` (or the rollout flow) changes traffic without a
restart. The champion is the arm named ``champion``, else the arm with the largest share; a failing
challenger falls back to it (the gateway logs and counts that).

Each team has its own arms (``tasks/core/teams.py``): a caller is routed among its team's, or among the
organisation's when its team has none (a team without an adapter of its own gets the organisation's champion,
and takes part in the organisation's A/B test like any caller). A team's arms are never routed to another team's
callers.

Each arm's model speaks its own FIM template: the request's prefix, suffix and context are rendered
in it here, so two families can be A/B tested on the same traffic, and the prompt the arm's model
saw is what the gateway logs. A long prefix is first cut to serving.window_chars at an anchor line
(``tasks.core.window.window_prefix``), so successive requests of a typing session share their prompt's
start and vLLM reuses its KV cache; the evaluation renders its prompts the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sqlalchemy.engine import Engine

from serving.errors import ApiError
from tasks.core.engines import make_backend
from tasks.core.engines.base import Backend, BackendError, Sampling, TextSink
from tasks.core.fim import FimPrompt, FimTemplate
from tasks.core.generate import Generation, ShowRule
from tasks.core.store import CHAMPION, Arm, read_arms
from tasks.core.teams import ORG
from tasks.core.window import window_prefix


@dataclass(frozen=True)
class FimRequest:
    """What the editor asked, independent of any model's format."""

    fim: FimPrompt
    source: FimTemplate | None  # the template the editor wrote the prompt in; None: prompt + suffix
    stop: list[str] | None  # the editor's stop strings, None: the serving model's
    max_tokens: int
    temperature: float
    top_p: float
    rule: ShowRule | None = None  # serving.min_logprob's cut at the first unsure token
    seed: int | None = None  # the editor's `seed`: the suggestion depends on it and the request alone


def stops_for(target: FimTemplate, request: FimRequest) -> list[str]:
    """The stop list for a model in ``target``: the editor's when it wrote in that template; else the target's
    own markers plus the editor's plain-text stops (its markers mean nothing to another family)."""
    if request.stop is None:
        return list(target.stops)
    if request.source == target:
        return request.stop
    theirs = request.source.stops if request.source is not None else ()
    return list(dict.fromkeys([*target.stops, *(s for s in request.stop if s not in theirs)]))


class UnknownArmError(LookupError):
    """A request named an arm that is not live; the message lists the live ones."""


def user_point(user_id: str, salt: str) -> float:
    """The user's sticky position in [0, 1)."""
    digest = hashlib.sha256(f"{salt}:{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign(user_id: str, salt: str, arms: list[Arm]) -> Arm:
    """The arm whose cumulative-share slice holds the user's point (arms by name; shares sum to 1)."""
    point = user_point(user_id, salt)
    ordered = sorted(arms, key=lambda a: a.name)
    edge = 0.0
    for arm in ordered:
        edge += arm.share
        if point < edge and arm.share > 0:
            return arm
    return next(a for a in reversed(ordered) if a.share > 0)  # float rounding at the top edge


def champion_of(arms: list[Arm]) -> Arm:
    named = [a for a in arms if a.name == CHAMPION]
    return named[0] if named else max(arms, key=lambda a: (a.share, a.name))


class Router:
    """Live arms (TTL cache over the store) and one backend per arm version."""

    def __init__(
        self,
        engine: Engine,
        salt: str,
        ttl_s: float,
        backend_timeout_s: float,
        backend_factory: Callable[[Arm, float], Backend] = make_backend,
        window: tuple[int, int] | None = None,
    ):
        self.engine = engine
        self.window = window  # (serving.window_chars, serving.window_step_chars): the prefix cut; None: whole
        self.backend_factory = backend_factory
        self.salt = salt
        self.ttl_s = ttl_s
        self.backend_timeout_s = backend_timeout_s
        self._arms: list[Arm] = []
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()
        # One backend per served model (backend, model_uri, served name, adapter): a share change keeps the loaded
        # model, a new version loads anew; embedded arms on one checkpoint share its weights
        # (tasks/core/engines/embedded.py).
        self._backends: dict[tuple[str, str, str | None, str | None], Backend] = {}

    async def arms(self) -> list[Arm]:
        """Every team's live arms (the organisation's too)."""
        if time.monotonic() - self._read_at >= self.ttl_s:
            async with self._lock:
                if time.monotonic() - self._read_at >= self.ttl_s:
                    self._arms = await asyncio.to_thread(read_arms, self.engine, None)
                    self._read_at = time.monotonic()
                    await self._drop_stale_backends()
        return self._arms

    async def arms_of(self, team: str) -> list[Arm]:
        """The arms a caller of `team` is routed among: its team's own, else the organisation's."""
        every = await self.arms()
        return [a for a in every if a.team == team] or [a for a in every if a.team == ORG]

    async def route(self, user_id: str, forced: str | None = None, team: str = ORG) -> tuple[Arm, Arm]:
        """(arm to try, champion to fall back to) for this user of `team`; `forced` names one of its arms."""
        arms = await self.arms_of(team)
        if not arms:
            raise UnknownArmError(
                "no arms are configured; add one with `tabrl arms --arm ...` or `tabrl serve --model DIR`"
            )
        champion = champion_of(arms)
        if forced is not None:
            match = [a for a in arms if a.name == forced]
            if not match:
                raise UnknownArmError(f"unknown arm {forced!r}; live arms: {', '.join(a.name for a in arms)}")
            return match[0], champion
        return assign(user_id, self.salt, arms), champion

    async def generate(self, arm: Arm, request: FimRequest, on_text: TextSink | None = None) -> tuple[str, Generation]:
        """(the prompt in the arm's template, its generation); on_text: its settled pieces as they come."""
        backend = self.backend(arm)
        template = await backend.template()
        fim = request.fim
        if self.window is not None:  # the same anchored cut the evaluation and training see
            fim = replace(fim, prefix=window_prefix(fim.prefix, *self.window))
        prompt = template.rerender(fim, request.source)
        stop = tuple(stops_for(template, request))
        sampling = Sampling(request.max_tokens, request.temperature, request.top_p, stop, request.rule, request.seed)
        gen = await backend.complete(prompt, sampling, on_text)
        return prompt, gen

    async def complete(
        self,
        arm: Arm,
        champion: Arm,
        request: FimRequest,
        on_fallback: Callable[[Arm, BackendError], None] = lambda arm, err: None,
        on_text: Callable[[Arm, str], None] | None = None,
    ) -> tuple[Arm, str, Generation]:
        """(arm that answered, the prompt its model saw, generation). When a challenger's backend fails, the
        champion answers (on_fallback is told); 502 when the champion itself fails. on_text: each settled piece of
        the suggestion as it comes, with the arm that made it (a streamed answer); an arm that fails after it sent
        a piece has no champion to fall back to (the client has part of its answer): 502."""
        sent: list[str] = []

        def sink(for_arm: Arm) -> TextSink | None:
            if on_text is None:
                return None
            tell = on_text

            def told(piece: str) -> None:
                sent.append(piece)
                tell(for_arm, piece)

            return told

        try:
            return arm, *await self.generate(arm, request, sink(arm))
        except BackendError as err:
            if arm.name == champion.name or sent:
                raise ApiError(502, f"arm {arm.name!r} ({arm.backend} {arm.model_uri}) failed: {err}") from err
            on_fallback(arm, err)
        try:
            return champion, *await self.generate(champion, request, sink(champion))
        except BackendError as err:
            raise ApiError(
                502,
                f"arm {arm.name!r} failed and champion arm {champion.name!r} ({champion.backend} "
                f"{champion.model_uri}) failed too: {err}",
            ) from err

    def backend(self, arm: Arm) -> Backend:
        key = _served(arm)
        if key not in self._backends:
            self._backends[key] = self.backend_factory(arm, self.backend_timeout_s)
        return self._backends[key]

    async def _drop_stale_backends(self) -> None:
        live = {_served(a) for a in self._arms}
        for key in [k for k in self._backends if k not in live]:
            await self._backends.pop(key).aclose()

    async def aclose(self) -> None:
        for backend in self._backends.values():
            await backend.aclose()
        self._backends.clear()


def _served(arm: Arm) -> tuple[str, str, str | None, str | None]:
    """What an arm's backend serves; arms that share it share one backend."""
    return (arm.backend, arm.model_uri, arm.served_model, arm.adapter)
