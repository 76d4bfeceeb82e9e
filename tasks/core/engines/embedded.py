"""The embedded engine: transformers in the gateway's own process (serving.backend: embedded).

* The gateway's `EmbeddedBackend` runs generation in a worker thread behind a lock, so a slow generation never
  blocks the event loop (other requests, feedback and /healthz keep being answered while the model works). A
  cancelled request (its client hung up) stops at the next token, or before it starts when it still waits for
  the lock. Every arm on one checkpoint shares one loaded copy of it; adapters load into it by name.
* Serving a version starts nothing: gateways load the checkpoint, or the adapter onto the shared base, on the
  next request after they see the new arms; an adapter's base is checked when it is served.
* An evaluation loads the model here and generates a batch together (`tasks.core.inference.InProcess`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch

from tasks.core.adapters import AdapterBaseError, check_base, is_adapter
from tasks.core.config import BackendName, Params
from tasks.core.engines.base import Backend, BackendError, Sampling, Served, ServeError, TextSink
from tasks.core.fim import FimFormatError, FimTemplate
from tasks.core.generate import Generation, LoadedModel, ModelLoadError, generate, load_model, split_stops
from tasks.core.inference import Engine, InProcess
from tasks.core.store import Arm
from tasks.core.streaming import Holdback, feed
from tasks.core.vllm import adapter_name


class Embedded:
    """serving.backend: embedded (see the module docstring)."""

    name: ClassVar[BackendName] = "embedded"
    remote: ClassVar[bool] = False

    def __init__(self, params: Params) -> None:
        self.params = params

    def serve(self, label: str, model_dir: str, base_dir: str | None) -> Served:
        if base_dir is None or not is_adapter(model_dir):
            return Served(model_dir)
        try:
            check_base(model_dir, base_dir, "serve")
        except AdapterBaseError as err:
            raise ServeError(str(err)) from err
        return Served(str(base_dir), adapter_name(label), model_dir)

    def unserve(self, served: Served) -> None:
        return None  # nothing was started

    def serve_champion(self, label: str, champion_dir: str, base_dir: str) -> Served:
        if not is_adapter(champion_dir):
            return Served(str(base_dir))
        return Served(str(base_dir), adapter_name(label), str(champion_dir))

    def retire(self, arm: Arm, live: list[Arm]) -> str | None:
        return None  # each gateway drops a backend once no arm names it

    def resync(self, arm: Arm) -> str | None:
        return None  # a gateway loads what its arms name on their first request

    @contextlib.contextmanager
    def evaluation(self, model_dir: Path, base_dir: str | Path | None) -> Iterator[Engine]:
        yield InProcess(load_model(model_dir, base_dir=base_dir))

    def identity(self, adapter: bool) -> dict:
        return {"backend": self.name, "vllm_args": [], "vllm_dtype": None, "adapter": "peft" if adapter else ""}

    @staticmethod
    def base_of(arm: Arm) -> str:
        return arm.model_uri

    @staticmethod
    def backend(arm: Arm, timeout_s: float) -> Backend:
        return EmbeddedBackend(arm.model_uri, arm.adapter, arm.served_model)


# transformers' from_pretrained is not thread-safe: it builds the model under process-wide "empty
# weights" patches, so two arms loading at once in two worker threads can leave one with meta
# tensors ("Cannot copy out of meta tensor"). Loads take turns; generation stays per arm.
_LOAD_LOCK = threading.Lock()


class _EmbeddedBase:
    """One checkpoint loaded in this process, shared by every arm served on it: the base itself (an arm with no
    adapter) and each arm's LoRA adapter, loaded under the arm's name into one PEFT model (no second copy of the
    base). Generation takes turns: one lock per base."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.lock = threading.Lock()
        self.users = 0  # backends holding it
        self._lm: LoadedModel | None = None
        self._peft = None  # the PeftModel once the first adapter is loaded
        self._adapters: dict[str, Path] = {}

    def loaded(self) -> LoadedModel:
        if self._lm is None:
            try:
                with _LOAD_LOCK:
                    self._lm = load_model(self.model_dir)
            except (ModelLoadError, FimFormatError, AdapterBaseError, OSError) as err:
                raise BackendError(f"cannot load model {self.model_dir}: {err}") from err
        return self._lm

    def with_adapter(self, served: str, path: Path) -> LoadedModel:
        """The model to generate with for the adapter served as `served` (loaded from path on first use, its base
        checked); call with the lock held."""
        lm = self.loaded()
        name = _peft_name(served)
        if name not in self._adapters:
            try:
                check_base(path, self.model_dir, "serve")
                with _LOAD_LOCK:
                    if self._peft is None:
                        from peft import PeftModel

                        self._peft = PeftModel.from_pretrained(lm.model, path, adapter_name=name)
                    else:
                        self._peft.load_adapter(path, adapter_name=name)
            except (AdapterBaseError, OSError, ValueError) as err:
                raise BackendError(f"cannot load adapter {path} on {self.model_dir}: {err}") from err
            self._peft.eval()
            self._adapters[name] = path
        self._peft.set_adapter(name)
        return LoadedModel(self._peft, lm.tokenizer, lm.template)

    def base_only(self) -> contextlib.AbstractContextManager[LoadedModel]:
        """The base without any adapter (call with the lock held)."""
        lm = self.loaded()
        if self._peft is None:
            return contextlib.nullcontext(lm)
        return _disabled(self._peft, lm)

    def drop_adapter(self, served: str) -> None:
        name = _peft_name(served)
        with self.lock:
            if self._peft is not None and name in self._adapters:
                self._peft.delete_adapter(name)
                del self._adapters[name]


def _peft_name(served: str) -> str:
    """The adapter's name inside the PEFT model: a served name (`tabrl-completion.team-v3-1f2e`, a path) may hold
    '.', which a torch module name may not."""
    return "a" + hashlib.sha256(served.encode()).hexdigest()[:24]


@contextlib.contextmanager
def _disabled(peft, lm: LoadedModel):
    with peft.disable_adapter():
        yield LoadedModel(peft, lm.tokenizer, lm.template)


_BASES: dict[str, _EmbeddedBase] = {}
_BASES_LOCK = threading.Lock()


_SEEDED = threading.Lock()  # torch has one generator per process, shared by every thread: one seeded draw at a time


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Around a generation with the request's own seed: no other seeded generation (another checkpoint's, in another
    thread) draws from the process's generator meanwhile, and the draws leave it as they found it, so requests
    without a seed go on as if it had not run. An unseeded generation on another checkpoint at the same moment can
    still draw from it in between: a seed holds exactly where every request has one (simulator.replay)."""
    if seed is None:
        yield
        return
    with _SEEDED, torch.random.fork_rng():
        yield


def _shared_base(model_dir: Path) -> _EmbeddedBase:
    key = os.path.realpath(model_dir)
    with _BASES_LOCK:
        base = _BASES.setdefault(key, _EmbeddedBase(model_dir))
        base.users += 1
        return base


def _release_base(base: _EmbeddedBase) -> None:
    with _BASES_LOCK:
        base.users -= 1
        if base.users <= 0:
            _BASES.pop(os.path.realpath(base.model_dir), None)


class EmbeddedBackend:
    """A local Hugging Face checkpoint, or a LoRA adapter on one, generating one request at a time per checkpoint.
    Every arm on the same checkpoint shares one loaded copy of it (adapters are loaded into it by name)."""

    def __init__(self, model_dir: str | Path, adapter: str | Path | None = None, name: str | None = None):
        self.model_dir = Path(model_dir)
        self.adapter = Path(adapter) if adapter is not None else None
        self.name = name or (str(self.adapter) if self.adapter is not None else None)
        self._base = _shared_base(self.model_dir)

    def _template(self) -> FimTemplate:
        with self._base.lock:
            return self._base.loaded().template

    async def template(self) -> FimTemplate:
        lm = self._base._lm
        if lm is not None:  # the hot path: no thread hop, no wait on a generation holding the lock
            return lm.template
        return await asyncio.to_thread(self._template)

    def _complete(
        self, prompt: str, s: Sampling, abandoned: threading.Event, on_text: TextSink | None
    ) -> Generation | None:
        with self._base.lock, _seeded(s.seed):
            if abandoned.is_set():  # cancelled while it waited for the model: never started
                return None
            if self.adapter is not None and self.name is not None:
                lm = self._base.with_adapter(self.name, self.adapter)
                return self._generate(lm, prompt, s, abandoned, on_text)
            with self._base.base_only() as lm:
                return self._generate(lm, prompt, s, abandoned, on_text)

    @staticmethod
    def _generate(
        lm: LoadedModel, prompt: str, s: Sampling, abandoned: threading.Event, on_text: TextSink | None
    ) -> Generation:
        args = (*lm, [prompt], s.max_tokens, s.temperature, s.top_p)
        if on_text is None:
            return generate(*args, seed=s.seed, stop=s.stop, rule=s.rule, abandoned=abandoned.is_set)[0]
        stop_ids = set(split_stops(lm.tokenizer, s.stop)[0])  # what generate ends a suggestion at, as it does
        holdback, sure_ids = Holdback(s.stop), []

        def on_token(token: int, logp: float | None) -> None:  # in this thread, as each token is drawn
            if token in stop_ids or holdback.closed:
                return
            sure = s.rule is None or logp is None or logp >= s.rule.min_logprob
            if sure:
                sure_ids.append(token)
            piece = holdback.release(lm.tokenizer.decode(sure_ids, skip_special_tokens=False), sure)
            if piece:
                on_text(piece)

        rule_temperature = s.rule.temperature if s.rule is not None else None
        with feed(lm.model, on_token, rule_temperature) as streamer:
            return generate(
                *args, seed=s.seed, stop=s.stop, rule=s.rule, abandoned=abandoned.is_set, streamer=streamer
            )[0]

    async def complete(self, prompt: str, sampling: Sampling, on_text: TextSink | None = None) -> Generation:
        """The generation, in a worker thread; with on_text, its settled pieces as they come (called in the event
        loop). Cancelled (the client hung up), the thread is told to stop at its next token, so the model is free
        for the next request at once."""
        abandoned = threading.Event()
        sink = None
        if on_text is not None:
            loop = asyncio.get_running_loop()

            def sink(piece: str) -> None:
                loop.call_soon_threadsafe(on_text, piece)

        work = asyncio.ensure_future(asyncio.to_thread(self._complete, prompt, sampling, abandoned, sink))
        try:
            gen = await asyncio.shield(work)
        except asyncio.CancelledError:
            abandoned.set()
            raise
        assert gen is not None, "only an abandoned generation returns None"
        return gen

    async def aclose(self) -> None:
        if self.adapter is not None and self.name is not None:
            await asyncio.to_thread(self._base.drop_adapter, self.name)
        _release_base(self._base)
