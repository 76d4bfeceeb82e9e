"""How an evaluation's prompts are completed: in a batch, by the model in this process or by a vLLM server.

Typing sessions (the gate's evaluation, `tabrl acceptance`, `tabrl headroom`, the learning bench) ask a model
for batches of completions through `Engine`; the serving engine of serving.backend hands one out
(`tasks.core.engines.open_engine`, which also says what is loaded or started for it).

* `InProcess` (embedded): the batch padded together (``tasks.core.generate.generate``).
* `VllmEngine` (vllm): every request of a batch in flight at once, so vLLM batches them continuously and reuses
  the KV cache of prompts that share their start (``window_prefix``). Answers are streamed: a request's time
  counts from its first token, not from when it was sent, and a batch fails only when the server streams nothing
  to any of its requests for serving.vllm_request_timeout_s (a stalled server; a slow one is waited for, however
  slow the CPU).

    with open_engine(model_dir, params, base_dir) as engine:
        gens = engine.complete(prompts, max_new_tokens=48)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from tasks.core.fim import FimTemplate
from tasks.core.generate import (
    Generation,
    LoadedModel,
    ShowRule,
    generate,
)
from tasks.core.greedy_rule import GREEDY_TOP_LOGPROBS
from tasks.core.vllm import (
    VllmError,
    completion_body,
    generation_from_vllm,
)

VLLM_SAMPLES_PER_CALL = 256  # FIM samples handed to a vLLM engine at once
VLLM_IN_FLIGHT = 64  # of which at most this many are on the server (64 keep its continuous batch full on 2 cores);
# the rest wait for a connection. None of them times out for waiting: see `_Watch`.


class Engine(Protocol):
    """Completes FIM prompts rendered in its model's template (``template``)."""

    @property
    def template(self) -> FimTemplate: ...

    def samples_per_call(self, batch_size: int) -> int:
        """How many independent prompts (FIM samples) to send at once, given evaluate.batch_size."""
        ...

    def complete(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        rule: ShowRule | None = None,
    ) -> list[Generation]: ...


@dataclass
class InProcess:
    """The model loaded here; a batch is generated together (left-padded)."""

    lm: LoadedModel

    @property
    def template(self) -> FimTemplate:
        return self.lm.template

    def samples_per_call(self, batch_size: int) -> int:
        return batch_size  # padded together: the batch's memory grows with it

    def complete(self, prompts, max_new_tokens, temperature=0.0, seed=0, rule=None) -> list[Generation]:
        return generate(*self.lm, prompts, max_new_tokens, temperature=temperature, seed=seed, rule=rule)


@dataclass
class VllmEngine:
    """A model a vLLM server serves under `model`; every prompt of a batch is one request, all in flight, each
    answer streamed back token by token (so the engine sees the server work on it)."""

    url: str
    model: str
    template: FimTemplate
    stops: tuple[str, ...]
    start: str = ""  # what an empty prompt is sent as (`tasks.vllm.start_of_text`)
    stall_s: float = 120.0  # serving.vllm_request_timeout_s: no token to any request for this long fails the batch
    vocab_size: int = 0  # the model's: a greedy show rule above T = 1 bounds the tokens outside the top-k with it

    def samples_per_call(self, batch_size: int) -> int:
        # all at once, VLLM_IN_FLIGHT on the server: vLLM batches them continuously, with no batch waiting for its
        # longest completion (200 FIM samples on 2 cores: 1.4x the samples/s of batches of 16, the same completions)
        return max(batch_size, VLLM_SAMPLES_PER_CALL)

    def complete(self, prompts, max_new_tokens, temperature=0.0, seed=0, rule=None) -> list[Generation]:
        return asyncio.run(self._complete(prompts, max_new_tokens, temperature, seed, rule))

    async def _complete(self, prompts, max_new_tokens, temperature, seed, rule) -> list[Generation]:
        # the client's connection pool keeps VLLM_IN_FLIGHT on the server; the rest wait for a connection. No read
        # timeout: a request waits for the server however long it queues there, and `_Watch` fails the batch only
        # when the server streams nothing to any of them for stall_s (a stalled server, not a slow one)
        limits = httpx.Limits(max_connections=min(max(len(prompts), 1), VLLM_IN_FLIGHT))
        watch = _Watch(self.stall_s)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.stall_s, read=None, pool=None), limits=limits) as c:
            batch = (self._one(c, watch, p, max_new_tokens, temperature, seed + i, rule) for i, p in enumerate(prompts))
            work = asyncio.ensure_future(asyncio.gather(*batch))
            return list(await watch.guard(work, f"vLLM at {self.url}", len(prompts)))

    async def _one(self, client, watch, prompt, max_new_tokens, temperature, seed, rule) -> Generation:
        # greedy, with a rule at the serving temperature: vLLM's log-probs are at T = 1, the top-k rescales them
        top = GREEDY_TOP_LOGPROBS if temperature == 0 and rule is not None and rule.temperature != 1.0 else 0
        prompt = prompt or self.start
        body = completion_body(self.model, prompt, max_new_tokens, temperature, 1.0, self.stops, seed, top)
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body | {"stream": True}) as response:
                if response.status_code != 200:
                    answer = (await response.aread()).decode(errors="replace")
                    raise VllmError(f"vLLM at {self.url} answered {response.status_code}: {answer[:300]}")
                choice, _ = await streamed_choice(response, lambda _choice: watch.tick())
        except httpx.HTTPError as err:
            raise VllmError(f"vLLM at {self.url} unreachable: {type(err).__name__}: {err}") from err
        return generation_from_vllm(
            {"choices": [choice]}, self.stops, 0.0, rule, greedy_top=top > 0, vocab_size=self.vocab_size
        )


class _Watch:
    """When a server last streamed a token to any request of one batch; `guard` fails the batch after stall_s
    without one. A request waiting in the server's queue (or for a connection) is not stalled while others move."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()

    async def guard(self, work: asyncio.Future, server: str, n: int):
        while True:
            done, _ = await asyncio.wait({work}, timeout=min(1.0, self.stall_s))
            if done:
                return work.result()
            if time.monotonic() - self.last > self.stall_s:
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                raise VllmError(
                    f"{server} streamed no token to any of {n} requests for {self.stall_s:.0f} s: it stalled "
                    "(serving.vllm_request_timeout_s)"
                )


async def streamed_choice(response: httpx.Response, on_chunk: Callable[[dict], None]) -> tuple[dict, dict | None]:
    """One streamed /v1/completions answer (server-sent events) joined into the choice a non-streamed answer
    has: its text, token ids, log-probs (tokens, token_logprobs, top_logprobs) and finish reason; and its usage
    (None unless stream_options.include_usage asked for it). on_chunk: told each chunk's choice as it comes."""
    text, ids, tokens, lps, tops, finish, usage = [], [], [], [], [], None, None
    async for line in response.aiter_lines():
        if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" not in chunk and not chunk.get("choices") and chunk.get("usage"):
            usage = chunk["usage"]  # include_usage's last chunk: no choices
            continue
        if "error" in chunk or not chunk.get("choices"):
            raise VllmError(f"vLLM stream broke off: {data[:300]}")
        choice = chunk["choices"][0]
        on_chunk(choice)
        text.append(choice.get("text") or "")
        ids.extend(choice.get("token_ids") or [])
        logprobs = choice.get("logprobs") or {}
        tokens.extend(logprobs.get("tokens") or [])
        lps.extend(logprobs.get("token_logprobs") or [])
        tops.extend(logprobs.get("top_logprobs") or [])
        finish = choice.get("finish_reason") or finish
    logprobs = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops or None}
    return {"text": "".join(text), "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}, usage
