"""The HTTP protocol of the gateway: what editors send (OpenAI completions, feedback, Continue events) and
what a hot route answers before any framework renders it (JSON or server-sent events)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from tasks.core.generate import Generation


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False  # a last chunk with `usage` and no choices, as OpenAI's


# OpenAI's completion parameters the gateway takes but does not serve, each with its neutral value (what OpenAI
# does when it is left out). Sent at that value, a parameter is accepted (clients send their defaults); at any other,
# the request is refused with 400 naming it, since the suggestion would not be what the client asked for
# (docs/how-to/continue.md, "OpenAI parameters").
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v in (None, False),  # the prompt is never echoed
    "best_of": lambda v: v in (None, 1),  # one sample: the one whose log-probs are logged and trained on
    "logprobs": lambda v: v is None,  # the behaviour log-probs are logged, not returned
    "presence_penalty": lambda v: v in (None, 0),  # the policy's own distribution is what is learnt
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send more fields (their defaults): see NEUTRAL

    model: str | None = None
    prompt: str | list[str]
    suffix: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=128)
    n: int = Field(1, ge=1, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)  # sampled from this seed alone (None: the serving process's draws)

    def unsupported(self) -> list[str]:
        """The parameters of NEUTRAL this request sets to another value than their neutral one, by name."""
        extra = self.model_extra or {}
        return sorted(name for name, neutral in NEUTRAL.items() if name in extra and not neutral(extra[name]))

    @property
    def include_usage(self) -> bool:
        """A stream that ends with a usage chunk (`stream_options.include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage


class FeedbackRequest(BaseModel):
    """An outcome for one of our completions. `shown: false` says the client never displayed it (it discarded an
    answer that no longer fit what the user typed): not shown, never a rejection, never trained on."""

    model_config = ConfigDict(extra="forbid")

    completion_id: str = Field(min_length=1, max_length=128)
    accepted: StrictBool | None = None
    accepted_chars: int | None = Field(None, ge=0)
    shown: StrictBool = True

    @model_validator(mode="after")
    def _answer(self) -> FeedbackRequest:
        if self.shown and self.accepted is None:
            raise ValueError("accepted is required (true or false) unless shown is false")
        if not self.shown and (self.accepted or self.accepted_chars is not None):
            raise ValueError("a suggestion that was not shown cannot be accepted: send shown=false alone")
        return self


class ContinueData(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    data: dict
    schema_: str = Field(alias="schema")
    level: str = "all"
    profileId: str | None = None


@dataclass(frozen=True)
class Answer:
    """What a hot route answers, before any framework renders it: a JSON body, or server-sent events."""

    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)
    record: dict = field(default_factory=dict)  # what the request log says of it (serving/logs.py): ids, no texts
    # when given: SSE events as they come (a streamed completion), then `data: [DONE]`; its headers are read once
    # the first event came (the arm that answers is known by then)
    stream: AsyncIterator[dict] | None = None


def encode_json(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def sse_chunk(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def text_chunk(completion_id: str, created: int, model: str, text: str, extra: dict | None = None) -> dict:
    """One streamed piece of a suggestion, as OpenAI's completion chunk (`extra`: more top-level fields)."""
    base = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
    return {**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}], **(extra or {})}


def usage(gen: Generation) -> dict[str, int | None]:
    """OpenAI's usage: the prompt's tokens as the model read them (None when the backend did not say), the
    completion's tokens as sampled (the stop token included), and their sum."""
    completion = len(gen.token_ids)
    prompt = gen.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": None if prompt is None else prompt + completion,
    }
