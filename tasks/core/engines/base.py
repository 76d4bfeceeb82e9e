"""What every serving engine is: the `ServingEngine` protocol, where a version is served (`Served`), and the
gateway's side of an engine (`Backend`, `Sampling`, `BackendError`).

Two generation protocols, on purpose: the gateway's `Backend` is async and completes one prompt, because each
editor request is cancelled on its own when its client hangs up (the model is freed for the next one at once);
an evaluation's `tasks.core.inference.Engine` is sync and completes a batch, because typing sessions hand over
many prompts at once (padded together in process, all in flight on vLLM). An engine hands out both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from tasks.core.config import BackendName, Params
from tasks.core.fim import FimTemplate
from tasks.core.generate import Generation, ShowRule
from tasks.core.inference import Engine
from tasks.core.store import Arm


class BackendError(RuntimeError):
    """A backend that could not produce a completion; the message says why."""


class UnknownModel(BackendError):
    """The vLLM server does not know the arm's adapter name (it restarted): load the adapter again."""


class ServeError(RuntimeError):
    """An engine that could not serve, retire or reload a version; the message says why (the engine's own words)."""


@dataclass(frozen=True)
class Sampling:
    """How one request is completed: length, sampling, the stop strings and the show rule."""

    max_tokens: int
    temperature: float
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    rule: ShowRule | None = None  # cut at the first unsure token (serving.min_logprob)
    seed: int | None = None  # OpenAI's `seed`: the same request and seed get the same suggestion, whatever else runs


TextSink = Callable[[str], None]
"""Told each piece of a suggestion that is certainly shown (`tasks/core/streaming.py`), as it is generated."""


class Backend(Protocol):
    """How one arm generates in the gateway: one prompt at a time, cancellable. With `on_text`, the suggestion's
    settled pieces as they come (a streamed answer); the Generation returned is the same either way."""

    async def template(self) -> FimTemplate: ...

    async def complete(self, prompt: str, sampling: Sampling, on_text: TextSink | None = None) -> Generation: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Served:
    """Where a version is served: what its arm records."""

    model_uri: str  # checkpoint dir (embedded; an adapter's base) or the vLLM server's URL
    served_model: str | None = None  # the adapter's load name (None: the server's or directory's one model)
    adapter: str | None = None  # the adapter directory on model_uri's base (None: a full checkpoint)
    seconds: float = 0.0  # from "start serving it" to "it answered" (load + probe, or process start + health)


class ServingEngine(Protocol):
    """One serving backend (serving.backend names it; `tasks.core.engines.ENGINES` holds them): a version's whole
    life on it, from being made servable to being retired, and the engine an evaluation types with. Built with the
    params of the run; `backend` and `base_of` need only the arm. Raises `ServeError` where it cannot serve."""

    name: ClassVar[BackendName]
    remote: ClassVar[bool]  # arms reach it over HTTP at their model_uri (servers `tabrl vllm` can list)

    def __init__(self, params: Params) -> None: ...

    def serve(self, label: str, model_dir: str, base_dir: str | None) -> Served:
        """Make a version (a checkpoint, or an adapter on base_dir) servable before any user is routed to it."""
        ...

    def unserve(self, served: Served) -> None:
        """Undo `serve` (a rollout that failed after it)."""
        ...

    def serve_champion(self, label: str, champion_dir: str, base_dir: str) -> Served:
        """Serve the registry's champion as the one arm (its base's server found or started where there is one)."""
        ...

    def retire(self, arm: Arm, live: list[Arm]) -> str | None:
        """Free what an arm no longer served held, unless a live arm still uses it; what was freed, in words."""
        ...

    def resync(self, arm: Arm) -> str | None:
        """Serve again what a live arm names and its engine lost (a restart); what was loaded, in words."""
        ...

    def evaluation(self, model_dir: Path, base_dir: str | Path | None) -> contextlib.AbstractContextManager[Engine]:
        """The engine that completes an evaluation's prompts for model_dir; what it loaded or started for the
        evaluation is freed when the block ends."""
        ...

    def identity(self, adapter: bool) -> dict:
        """What of this engine decides a greedy completion (part of the completion cache's key)."""
        ...

    @staticmethod
    def base_of(arm: Arm) -> str:
        """The checkpoint an arm's model runs on (an adapter arm's base)."""
        ...

    @staticmethod
    def backend(arm: Arm, timeout_s: float) -> Backend:
        """How the gateway generates for an arm."""
        ...
