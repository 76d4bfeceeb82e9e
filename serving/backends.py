"""How an arm generates: one interface, two implementations, chosen once per arm by `make_backend`.

* ``EmbeddedBackend``: transformers in the gateway process (``tasks.core.generate``), run in a worker
  thread behind a lock so a slow generation never blocks the event loop (other requests, feedback
  and /healthz keep being answered while the model works). A cancelled request (its client hung up)
  stops at the next token, or before it starts when it still waits for the lock.
* ``VLLMBackend``: an OpenAI-compatible vLLM server, called with ``logprobs: 0`` and
  ``return_token_ids: true`` so the behaviour log-probs and token ids are logged. The raw FIM
  prompt is always sent: vLLM's ``suffix`` parameter is rejected for Qwen2.5-Coder. A cancelled
  request closes its HTTP connection, and vLLM aborts a request whose client went away.

Both apply a request's ``ShowRule`` (cut at the first unsure token) to the log-probs they log, and
return ``tasks.core.generate.Generation`` (text, token ids, per-token log-probs); both raise
``BackendError`` with the reason when they cannot answer, which the gateway turns into a 502.
Both say which FIM template their model speaks (``template``): the gateway renders every prompt in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from tasks.core.adapters import AdapterBaseError, check_base
from tasks.core.fim import FimFormatError, FimTemplate, template_for_model_name
from tasks.core.generate import (
    Generation,
    LoadedModel,
    ModelLoadError,
    ShowRule,
    generate,
    load_model,
    model_template,
)
from tasks.core.store import Arm
from tasks.core.vllm import (
    VllmError,
    base_of,
    completion_body,
    generation_from_vllm,
    load_adapter,
    served_models,
    start_of_text,
)

# transformers' from_pretrained is not thread-safe: it builds the model under process-wide "empty
# weights" patches, so two arms loading at once in two worker threads can leave one with meta
# tensors ("Cannot copy out of meta tensor"). Loads take turns; generation stays per arm.
_LOAD_LOCK = threading.Lock()


class BackendError(RuntimeError):
    """A backend that could not produce a completion; the message says why."""


class UnknownModel(BackendError):
    """The vLLM server does not know the arm's adapter name (it restarted): load the adapter again."""


@dataclass(frozen=True)
class Sampling:
    """How one request is completed: length, sampling, the stop strings and the show rule."""

    max_tokens: int
    temperature: float
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    rule: ShowRule | None = None  # cut at the first unsure token (serving.min_logprob)


class Backend(Protocol):
    async def template(self) -> FimTemplate: ...

    async def complete(self, prompt: str, sampling: Sampling) -> Generation: ...

    async def aclose(self) -> None: ...


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

    def with_adapter(self, name: str, path: Path) -> LoadedModel:
        """The model to generate with for the adapter `name` (loaded from path on first use, its base checked);
        call with the lock held."""
        lm = self.loaded()
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

    def drop_adapter(self, name: str) -> None:
        with self.lock:
            if self._peft is not None and name in self._adapters:
                self._peft.delete_adapter(name)
                del self._adapters[name]


@contextlib.contextmanager
def _disabled(peft, lm: LoadedModel):
    with peft.disable_adapter():
        yield LoadedModel(peft, lm.tokenizer, lm.template)


_BASES: dict[str, _EmbeddedBase] = {}
_BASES_LOCK = threading.Lock()


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

    def _complete(self, prompt: str, s: Sampling, abandoned: threading.Event) -> Generation | None:
        with self._base.lock:
            if abandoned.is_set():  # cancelled while it waited for the model: never started
                return None
            if self.adapter is not None and self.name is not None:
                return self._generate(self._base.with_adapter(self.name, self.adapter), prompt, s, abandoned)
            with self._base.base_only() as lm:
                return self._generate(lm, prompt, s, abandoned)

    @staticmethod
    def _generate(lm: LoadedModel, prompt: str, s: Sampling, abandoned: threading.Event) -> Generation:
        return generate(
            *lm, [prompt], s.max_tokens, s.temperature, s.top_p, stop=s.stop, rule=s.rule, abandoned=abandoned.is_set
        )[0]

    async def complete(self, prompt: str, sampling: Sampling) -> Generation:
        """The generation, in a worker thread. Cancelled (the client hung up), the thread is told to stop at its next
        token, so the model is free for the next request at once."""
        abandoned = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(self._complete, prompt, sampling, abandoned))
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


class VLLMBackend:
    """An OpenAI-compatible vLLM server at base_url (with or without the trailing /v1), asked for `model` (None: the
    one model it lists). With `adapter`, model is a LoRA adapter's load name: when the server answers that it does
    not know it (it restarted and lost its runtime adapters), the adapter is loaded again from that directory under
    the same name, once, and the request retried: the arms table, not the server's memory, says what is served."""

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 30.0, adapter: str | None = None):
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else root + "/v1"
        self.model = model  # None: the one model the server lists, looked up on first use
        self.adapter = adapter
        self._root: str | None = None  # where vLLM loaded it from (its /v1/models `root`)
        self._template: FimTemplate | None = None
        self._start: str | None = None  # what an empty prompt is sent as, read once
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)))

    async def _model_name(self) -> str:
        if self.model is None:
            body = await self._request("GET", "/models")
            cards = body.get("data", [])
            if len(cards) != 1:
                names = [m.get("id") for m in cards]
                raise BackendError(f"vLLM at {self.base_url} serves {names}; set the arm's model explicitly")
            self.model, self._root = cards[0]["id"], cards[0].get("root")
        return self.model

    async def template(self) -> FimTemplate:
        """The served model's template: recorded with its adapter (an adapter arm), or with (or inferred from) its
        checkpoint when vLLM serves a directory this machine sees (its `root`), else the one Continue would choose
        for its name."""
        if self._template is None:
            name = await self._model_name()
            local = next(
                (p for p in (self.adapter, self._root, name) if p and (Path(p) / "fim_template.json").is_file()), None
            ) or next((p for p in (self._root, name) if p and (Path(p) / "config.json").is_file()), None)
            if local is not None:
                try:
                    self._template = await asyncio.to_thread(model_template, local)
                except (FimFormatError, OSError) as err:
                    raise BackendError(f"cannot read the FIM template of {local}: {err}") from err
            else:
                self._template = template_for_model_name(name)
                if self._template is None:
                    raise BackendError(
                        f"cannot tell the FIM template of vLLM model {name!r}: serve a checkpoint directory "
                        "(`tabrl import-model` records its template) or a model name Continue knows"
                    )
        return self._template

    async def _request(self, method: str, path: str, json: dict | None = None) -> dict:
        try:
            response = await self._client.request(method, self.base_url + path, json=json)
        except httpx.HTTPError as err:
            raise BackendError(f"vLLM at {self.base_url} unreachable: {type(err).__name__}: {err}") from err
        if response.status_code == 404 and self.adapter is not None and "does not exist" in response.text:
            raise UnknownModel(f"vLLM at {self.base_url} does not know {self.model!r}")
        if response.status_code != 200:
            raise BackendError(f"vLLM at {self.base_url}{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    async def complete(self, prompt: str, sampling: Sampling) -> Generation:
        """The show rule is applied to the log-probs vLLM returns, those under logits / temperature
        (--logprobs-mode processed_logprobs): the rule's own when the request runs at the serving temperature."""
        started = time.perf_counter()
        try:
            body = await self._complete(prompt, sampling)
        except UnknownModel:
            await asyncio.to_thread(self._reload_adapter)
            body = await self._complete(prompt, sampling)
        latency_ms = (time.perf_counter() - started) * 1000.0
        try:
            return generation_from_vllm(body, sampling.stop, latency_ms, sampling.rule)
        except VllmError as err:
            raise BackendError(str(err)) from err

    async def _complete(self, prompt: str, sampling: Sampling) -> dict:
        return await self._request(
            "POST",
            "/completions",
            completion_body(
                await self._model_name(),
                prompt or await self._start_text(),
                sampling.max_tokens,
                sampling.temperature,
                sampling.top_p,
                sampling.stop,
                seed=None,
            ),
        )

    async def _start_text(self) -> str:
        """What an empty prompt (a prefix-only model at the top of a file) is sent as; the server's base must be a
        directory this host sees, to read its tokenizer."""
        if self._start is None:
            try:
                root = self._root or await asyncio.to_thread(base_of, self.base_url.removesuffix("/v1"))
                self._start = await asyncio.to_thread(start_of_text, root)
            except (VllmError, OSError, ValueError) as err:
                raise BackendError(f"an empty prompt cannot be sent to vLLM at {self.base_url}: {err}") from err
        return self._start

    def _reload_adapter(self) -> None:
        """Load the arm's adapter into a server that lost it (restarted), after checking the server's base is its."""
        server = self.base_url.removesuffix("/v1")
        try:
            root = base_of(server)
            if Path(root, "config.json").is_file():  # the server's base is a directory this host sees: check it
                check_base(self.adapter, root, "serve")
            load_adapter(server, str(self.model), str(self.adapter))
        except VllmError as err:
            # requests in flight when the server restarted all land here; one of them loads it, the others are
            # refused ("already been loaded"): served now is all that matters
            if str(self.model) not in served_models(server):
                raise BackendError(
                    f"adapter {self.model!r} is not on {server} and could not be loaded again: {err}"
                ) from err
        except AdapterBaseError as err:
            raise BackendError(
                f"adapter {self.model!r} is not on {server} and could not be loaded again: {err}"
            ) from err

    async def aclose(self) -> None:
        await self._client.aclose()


def make_backend(arm: Arm, timeout_s: float) -> Backend:
    """The backend an arm names: its model_uri is a checkpoint dir (embedded; an adapter's base) or a vLLM base URL,
    asked for the arm's served model (a LoRA adapter's load name) when it names one."""
    if arm.backend == "vllm":
        return VLLMBackend(arm.model_uri, model=arm.served_model, timeout_s=timeout_s, adapter=arm.adapter)
    return EmbeddedBackend(arm.model_uri, arm.adapter, arm.served_model)
