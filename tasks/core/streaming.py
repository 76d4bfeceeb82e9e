"""What of a suggestion may be sent before its generation ends: the text that is certainly a prefix of the suggestion
that will be shown (and logged), however the rest of the generation goes.

A suggestion is cut three ways once generation ends (`tasks/core/generate.py`): at its first stop string, at its
first unsure token (the show rule, serving.min_logprob), and it is nothing at all when what is left is blank. So,
as tokens arrive, `Holdback` releases text only

- from tokens the show rule calls sure (the first unsure token ends every release: the suggestion stops there);
- before any stop string (once one appears, the suggestion ends there), and never the end of the text so far
  that is the start of a stop string (it may still complete it);
- once a non-blank character has come (a blank suggestion is no suggestion: nothing of it is ever sent).

`release` takes the decoded text of all the sure tokens so far (the caller decodes the token ids: a token cut in
the middle of a character decodes to U+FFFD, held back here until it completes) and returns what may be sent now.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class Holdback:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.tail = max((len(s) for s in self.stops), default=1) - 1  # the most a stop string may still claim
        self.sent = ""
        self.closed = False  # a stop string or an unsure token came: nothing more is released

    def release(self, text: str, sure: bool = True) -> str:
        """The new text that may be sent, given `text`: the decoded sure tokens so far (`sure`: the newest token is
        sure; False closes the release, the suggestion ends before that token)."""
        if self.closed:
            return ""
        if not sure:
            self.closed = True
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.closed, settled = True, text[:cut]
        else:
            settled = text if self.closed else text[: self._unclaimed(text)]
        settled = settled.split(REPLACEMENT, 1)[0]  # a character still incomplete: wait for its next token
        if not settled.strip() or not settled.startswith(self.sent):
            return ""
        new, self.sent = settled[len(self.sent) :], settled
        return new

    def _unclaimed(self, text: str) -> int:
        """Where the end of `text` that may begin a stop string starts (len(text) when none may)."""
        for i in range(max(0, len(text) - self.tail), len(text)):
            if any(stop.startswith(text[i:]) for stop in self.stops):
                return i
        return len(text)


class TokenFeed:
    """A transformers streamer (`generate(..., streamer=)`) for one prompt: each new token, with its log-prob at
    `temperature` under the raw logits it was drawn from (the show rule's; None without a temperature), goes to
    `on_token` as it is generated. The logits come from a hook on the model's output layer (`feed`), not from the
    sampling's processed scores."""

    def __init__(self, on_token: Callable[[int, float | None], None], temperature: float | None) -> None:
        self.on_token, self.temperature = on_token, temperature
        self.logits: list[Any] = []  # each forward's last-position logits, in step order
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # transformers puts the prompt first
            self._prompt_seen = True
            return
        import torch

        token = int(value.reshape(-1)[0])
        logp = None
        if self.temperature is not None:
            step = self.logits[len(self.tokens)]  # the forward that drew this token
            logp = float(torch.log_softmax(step.float() / self.temperature, dim=-1)[token])
        self.tokens.append(token)
        self.on_token(token, logp)

    def end(self) -> None:
        """transformers' end of generation: nothing to flush (the caller sends what is left)."""


@contextlib.contextmanager
def feed(model: Any, on_token: Callable[[int, float | None], None], temperature: float | None) -> Iterator[TokenFeed]:
    """A TokenFeed for one generation with `model`, its output layer hooked for the raw logits while it runs."""
    streamer = TokenFeed(on_token, temperature)

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        streamer.logits.append(output[0, -1, :].detach())

    hook = model.get_output_embeddings().register_forward_hook(keep)
    try:
        yield streamer
    finally:
        hook.remove()
