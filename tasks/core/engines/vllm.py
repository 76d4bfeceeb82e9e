"""The vLLM engine: OpenAI-compatible vLLM servers reached over HTTP on loopback (serving.backend: vllm); the
servers themselves, their records and their runtime LoRA endpoints are `tasks.core.vllm`'s.

* The gateway's `VLLMBackend` calls a server with ``logprobs: 0`` and ``return_token_ids: true`` so the
  behaviour log-probs and token ids are logged. The raw FIM prompt is always sent: vLLM's ``suffix`` parameter is
  rejected for Qwen2.5-Coder. A cancelled request closes its HTTP connection, and vLLM aborts a request whose
  client went away.
* A version is served as a LoRA adapter (serving.adapter_serving: lora) on its base's one server, loaded at
  runtime under a name never used before and asked once; no new process, live within a second. A full
  checkpoint (or an adapter with adapter_serving: merged, merged first) gets a `vllm serve` process of its own,
  health-checked: blue/green, the old process keeps serving until the arms switch.
* An evaluation types an adapter on its base's server under a name of its own (unloaded after), and a full
  checkpoint (or a merged adapter, where serving.adapter_serving or evaluate.adapter_engine says merged) on the
  server that already serves it on this host, else on one started for the evaluation and stopped after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx

from tasks.core.adapters import AdapterBaseError, check_base, is_adapter, read_base
from tasks.core.config import BackendName, Params
from tasks.core.engines.base import Backend, BackendError, Sampling, Served, ServeError, TextSink, UnknownModel
from tasks.core.fim import FimFormatError, FimTemplate, template_for_model_name
from tasks.core.generate import Generation, merged_dir, model_template, save_merged, stops_of
from tasks.core.inference import Engine, VllmEngine, streamed_choice
from tasks.core.store import Arm
from tasks.core.streaming import Holdback
from tasks.core.vllm import (
    VllmError,
    adapter_name,
    base_of,
    base_server,
    completion_body,
    generation_from_vllm,
    load_adapter,
    probe,
    recorded_servers,
    same_checkpoint,
    served_models,
    server_dtype,
    start_of_text,
    start_vllm,
    stop_vllm,
    stop_vllm_at,
    unload_adapter,
)

log = logging.getLogger(__name__)


class Vllm:
    """serving.backend: vllm (see the module docstring)."""

    name: ClassVar[BackendName] = "vllm"
    remote: ClassVar[bool] = True

    def __init__(self, params: Params) -> None:
        self.params = params

    @property
    def _adapters_merged(self) -> bool:
        """Does an evaluation type an adapter as merged weights (serving.adapter_serving or evaluate.adapter_engine:
        merged), not as a LoRA adapter on its base's server?"""
        return self.params.serving.adapter_serving == "merged" or self.params.evaluate.adapter_engine == "merged"

    def serve(self, label: str, model_dir: str, base_dir: str | None) -> Served:
        adapter = base_dir is not None and is_adapter(model_dir)
        try:
            if adapter and self.params.serving.adapter_serving == "lora":
                return self._load(label, model_dir, str(base_dir))
            if adapter:  # adapter_serving: merged
                model_dir = str(save_merged(model_dir, base_dir, merged_dir(model_dir, self.params.paths.models_dir)))
            return Served(start_vllm(model_dir, self.params).url)
        except (VllmError, AdapterBaseError) as err:
            raise ServeError(str(err)) from err

    def _load(self, label: str, adapter_dir: str, base_dir: str) -> Served:
        """The adapter loaded on its base's one server and asked once; unloaded again when it does not answer."""
        server = base_server(base_dir, self.params)
        check_base(adapter_dir, server.model_dir, "serve")
        name = adapter_name(label)
        seconds = load_adapter(server.url, name, adapter_dir)
        started = time.perf_counter()
        try:
            probe(server.url, name)
        except VllmError:
            unload_adapter(server.url, name)
            raise
        return Served(server.url, name, adapter_dir, seconds + time.perf_counter() - started)

    def unserve(self, served: Served) -> None:
        if served.served_model is not None and served.adapter is not None:
            unload_adapter(served.model_uri, served.served_model)
        else:
            stop_vllm_at(served.model_uri, self.params)

    def serve_champion(self, label: str, champion_dir: str, base_dir: str) -> Served:
        adapter = str(champion_dir) if is_adapter(champion_dir) else None
        try:
            server = base_server(base_dir, self.params)
            if adapter is None:
                return Served(server.url, server.model_dir)
            name = adapter_name(label)
            load_adapter(server.url, name, adapter)
        except VllmError as err:
            raise ServeError(str(err)) from err
        return Served(server.url, name, adapter)

    def retire(self, arm: Arm, live: list[Arm]) -> str | None:
        """An adapter is unloaded from its server, a full-weight server (blue/green) stopped; a base server stays
        while any arm is on it. A server that is already gone is no error: what is retired is not served either
        way."""
        if (arm.model_uri, arm.served_model) in {(a.model_uri, a.served_model) for a in live}:
            return None
        try:
            if arm.served_model is not None:
                if unload_adapter(arm.model_uri, arm.served_model):
                    return f"unloaded adapter {arm.served_model} ({arm.model_version}) from {arm.model_uri}"
            elif arm.model_uri not in {a.model_uri for a in live} and stop_vllm_at(arm.model_uri, self.params):
                return f"stopped the vLLM server of {arm.model_version} at {arm.model_uri}"
        except VllmError as err:
            log.warning("retiring %s: %s", arm.model_version, err)
        return None

    def resync(self, arm: Arm) -> str | None:
        if arm.adapter is None or arm.served_model is None:
            return None
        try:
            if arm.served_model in served_models(arm.model_uri):
                return None
            load_adapter(arm.model_uri, arm.served_model, arm.adapter)
        except VllmError as err:
            raise ServeError(str(err)) from err
        return f"{arm.name}: {arm.model_version} as {arm.served_model} on {arm.model_uri}"

    @contextlib.contextmanager
    def evaluation(self, model_dir: Path, base_dir: str | Path | None) -> Iterator[Engine]:
        template = model_template(model_dir)
        tokenizer_dir = (base_dir or read_base(model_dir).path) if is_adapter(model_dir) else model_dir
        stops = _stops(tokenizer_dir, template)
        start = start_of_text(str(tokenizer_dir))
        vocab = int(json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"])
        stall = self.params.serving.vllm_request_timeout_s

        def typing(url: str, model: str) -> VllmEngine:
            return VllmEngine(url, model, template, stops, start, stall, vocab)

        if is_adapter(model_dir) and not self._adapters_merged:
            server = base_server(tokenizer_dir, self.params)
            name = adapter_name(f"eval/{model_dir.name}")
            load_adapter(server.url, name, model_dir)
            try:
                yield typing(server.url, name)
            finally:
                unload_adapter(server.url, name)
            return
        merged = None  # a merged copy made for this evaluation only: deleted after it (a merged arm's is kept)
        if is_adapter(model_dir):
            target = merged_dir(model_dir, self.params.paths.models_dir)
            merged = None if (target / "config.json").is_file() else target
            model_dir = save_merged(model_dir, base_dir, target)
        running = next((s for s in recorded_servers(self.params) if same_checkpoint(s.model_dir, model_dir)), None)
        try:
            server = running or start_vllm(model_dir, self.params)
            try:
                yield typing(server.url, server.model_dir)
            finally:
                if running is None and server.pid is not None:
                    stop_vllm(server.pid)
        finally:
            if merged is not None:
                shutil.rmtree(merged, ignore_errors=True)

    def identity(self, adapter: bool) -> dict:
        serving = self.params.serving
        runs_as = "merged" if self._adapters_merged else "lora"
        return {
            "backend": self.name,
            "vllm_args": serving.vllm_args,
            "vllm_dtype": server_dtype(serving),
            "adapter": runs_as if adapter else "",
        }

    @staticmethod
    def base_of(arm: Arm) -> str:
        try:
            return base_of(arm.model_uri)
        except VllmError as err:
            raise ServeError(str(err)) from err

    @staticmethod
    def backend(arm: Arm, timeout_s: float) -> Backend:
        return VLLMBackend(arm.model_uri, model=arm.served_model, timeout_s=timeout_s, adapter=arm.adapter)


def _stops(tokenizer_dir: str | Path, template: FimTemplate) -> tuple[str, ...]:
    """The stop strings in-process generation uses: the template's and the tokenizer's end of text."""
    from transformers import AutoTokenizer

    return stops_of(template, AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))


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
        if response.status_code != 200:
            raise self._refused(response.status_code, response.text, path)
        return response.json()

    def _refused(self, status: int, text: str, path: str = "/completions") -> BackendError:
        """The error of an answer other than 200: UnknownModel when the server lost the arm's adapter."""
        if status == 404 and self.adapter is not None and "does not exist" in text:
            return UnknownModel(f"vLLM at {self.base_url} does not know {self.model!r}")
        return BackendError(f"vLLM at {self.base_url}{path} answered {status}: {text[:300]}")

    async def complete(self, prompt: str, sampling: Sampling, on_text: TextSink | None = None) -> Generation:
        """The show rule is applied to the log-probs vLLM returns, those under logits / temperature
        (--logprobs-mode processed_logprobs): the rule's own when the request runs at the serving temperature.
        on_text: vLLM's stream relayed, its settled pieces as they come (`_relay`)."""
        started = time.perf_counter()
        try:
            body = await self._complete(prompt, sampling, on_text)
        except UnknownModel:
            await asyncio.to_thread(self._reload_adapter)
            body = await self._complete(prompt, sampling, on_text)
        latency_ms = (time.perf_counter() - started) * 1000.0
        try:
            return generation_from_vllm(body, sampling.stop, latency_ms, sampling.rule)
        except VllmError as err:
            raise BackendError(str(err)) from err

    async def _complete(self, prompt: str, sampling: Sampling, on_text: TextSink | None) -> dict:
        s = sampling
        body = completion_body(
            await self._model_name(),
            prompt or await self._start_text(),
            s.max_tokens,
            s.temperature,
            s.top_p,
            s.stop,
            s.seed,
        )
        if on_text is None:
            return await self._request("POST", "/completions", body)
        return await self._relay(body, s, on_text)

    async def _relay(self, body: dict, sampling: Sampling, on_text: TextSink) -> dict:
        """The same request streamed (the same tokens and log-probs, joined into the answer unstreamed reads): each
        chunk's text goes on while its tokens are sure, through a Holdback (`tasks/core/streaming.py`)."""
        holdback, text = Holdback(sampling.stop), ""
        rule = sampling.rule

        def on_chunk(choice: dict) -> None:
            nonlocal text
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            sure = rule is None or all(lp is not None and lp >= rule.min_logprob for lp in lps)
            text += (choice.get("text") or "") if sure else ""
            if piece := holdback.release(text, sure):
                on_text(piece)

        streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self._client.stream("POST", self.base_url + "/completions", json=streamed) as response:
                if response.status_code != 200:
                    raise self._refused(response.status_code, (await response.aread()).decode(errors="replace"))
                choice, usage = await streamed_choice(response, on_chunk)
        except httpx.HTTPError as err:
            raise BackendError(f"vLLM at {self.base_url} unreachable: {type(err).__name__}: {err}") from err
        except VllmError as err:
            raise BackendError(str(err)) from err
        return {"choices": [choice], "usage": usage}

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
