"""How an arm generates: one interface, two implementations, chosen once per arm by `make_backend`.

* ``EmbeddedBackend``: transformers in the gateway process (``tasks.generate``), run in a worker
  thread behind a lock so a slow generation never blocks the event loop (other requests, feedback
  and /healthz keep being answered while the model works).
* ``VLLMBackend``: an OpenAI-compatible vLLM server, called with ``logprobs: 0`` and
  ``return_token_ids: true`` so the behaviour log-probs and token ids are logged. The raw FIM
  prompt is always sent: vLLM's ``suffix`` parameter is rejected for Qwen2.5-Coder.

Both apply a request's ``ShowRule`` (cut at the first unsure token) to the log-probs they log, and
return ``tasks.generate.Generation`` (text, token ids, per-token log-probs); both raise
``BackendError`` with the reason when they cannot answer, which the gateway turns into a 502.
Both say which FIM template their model speaks (``template``): the gateway renders every prompt in it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from serving.store import Arm
from tasks.fim import FimFormatError, FimTemplate, parse_completion, template_for_model_name
from tasks.generate import (
    Generation,
    LoadedModel,
    ModelLoadError,
    ShowRule,
    cut_unsure,
    generate,
    load_model,
    model_template,
)

VLLM_MAX_STOP = 4
# transformers' from_pretrained is not thread-safe: it builds the model under process-wide "empty
# weights" patches, so two arms loading at once in two worker threads can leave one with meta
# tensors ("Cannot copy out of meta tensor"). Loads take turns; generation stays per arm.
_LOAD_LOCK = threading.Lock()


class BackendError(RuntimeError):
    """A backend that could not produce a completion; the message says why."""


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


class EmbeddedBackend:
    """A local Hugging Face checkpoint, loaded on first use, generating one request at a time."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()  # one generation at a time: the model is not re-entrant
        self._lm: LoadedModel | None = None

    def _load(self) -> LoadedModel:
        if self._lm is None:
            try:
                with _LOAD_LOCK:
                    self._lm = load_model(self.model_dir)
            except (ModelLoadError, FimFormatError, OSError) as err:
                raise BackendError(f"cannot load model {self.model_dir}: {err}") from err
        return self._lm

    def _template(self) -> FimTemplate:
        with self._lock:
            return self._load().template

    async def template(self) -> FimTemplate:
        if self._lm is not None:  # the hot path: no thread hop, no wait on a generation holding the lock
            return self._lm.template
        return await asyncio.to_thread(self._template)

    def _complete(self, prompt: str, s: Sampling) -> Generation:
        with self._lock:
            lm = self._load()
            return generate(*lm, [prompt], s.max_tokens, s.temperature, s.top_p, stop=s.stop, rule=s.rule)[0]

    async def complete(self, prompt: str, sampling: Sampling) -> Generation:
        return await asyncio.to_thread(self._complete, prompt, sampling)

    async def aclose(self) -> None:
        self._lm = None


class VLLMBackend:
    """An OpenAI-compatible vLLM server at base_url (with or without the trailing /v1)."""

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 30.0):
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else root + "/v1"
        self.model = model  # None: the one model the server lists, looked up on first use
        self._root: str | None = None  # where vLLM loaded it from (its /v1/models `root`)
        self._template: FimTemplate | None = None
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
        """The served model's template: recorded with (or inferred from) its checkpoint when vLLM serves a
        directory this machine sees (its `root`), else the one Continue would choose for its name."""
        if self._template is None:
            name = await self._model_name()
            local = next((p for p in (self._root, name) if p and (Path(p) / "config.json").is_file()), None)
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
        if response.status_code != 200:
            raise BackendError(f"vLLM at {self.base_url}{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    async def complete(self, prompt: str, sampling: Sampling) -> Generation:
        """The show rule is applied to the log-probs vLLM returns, those under logits / temperature
        (--logprobs-mode processed_logprobs): the rule's own when the request runs at the serving temperature."""
        started = time.perf_counter()
        body = await self._request(
            "POST",
            "/completions",
            {
                "model": await self._model_name(),
                "prompt": prompt,  # raw FIM prompt; never `suffix` (rejected for Qwen2.5-Coder)
                "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                # vLLM takes at most 4 stop strings (OpenAI's limit); the full list is applied to the text below.
                "stop": list(sampling.stop)[:VLLM_MAX_STOP],
                "logprobs": 0,  # the sampled token's log-prob only
                "return_token_ids": True,
                "skip_special_tokens": False,
            },
        )
        latency_ms = (time.perf_counter() - started) * 1000.0
        return generation_from_vllm(body, sampling.stop, latency_ms, sampling.rule)

    async def aclose(self) -> None:
        await self._client.aclose()


def generation_from_vllm(
    body: dict, stop: Sequence[str], latency_ms: float, rule: ShowRule | None = None
) -> Generation:
    """Map one vLLM /v1/completions choice onto a Generation (token ids + behaviour log-probs), cut by rule.
    A cut's text is the kept tokens' strings (vLLM's `logprobs.tokens`); when they do not spell the start of
    the answer (a character split across tokens), nothing is shown: the model was unsure there anyway."""
    try:
        choice = body["choices"][0]
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        tokens = (choice.get("logprobs") or {}).get("tokens")
        raw = choice["text"]
    except (KeyError, IndexError, TypeError) as err:
        raise BackendError(f"vLLM answer lacks {err}: {str(body)[:300]}") from err
    if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
        raise BackendError("vLLM answer lacks token ids or log-probs (needs a vLLM with return_token_ids)")
    gen = Generation(
        text=parse_completion(raw, tuple(stop)),
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(lp) for lp in logprobs],
        raw_text=raw,
        latency_ms=latency_ms,
        finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
    )
    unsure = None if rule is None else rule.first_unsure(gen.logprobs, gen.finish_reason == "stop")
    if unsure is None:
        return gen
    if tokens is None or len(tokens) != len(token_ids):
        raise BackendError("vLLM answer lacks the token strings (logprobs.tokens) a cut at an unsure token needs")
    kept = "".join(tokens[:unsure])
    if not raw.startswith(kept):  # a character split across the kept tokens: show nothing
        unsure, kept = 0, ""
    return cut_unsure(gen, unsure, kept, stop)


def make_backend(arm: Arm, timeout_s: float) -> Backend:
    """The backend an arm names: its model_uri is a checkpoint dir (embedded) or a vLLM base URL."""
    if arm.backend == "vllm":
        return VLLMBackend(arm.model_uri, timeout_s=timeout_s)
    return EmbeddedBackend(arm.model_uri)
