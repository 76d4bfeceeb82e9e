"""Why an in-process generation may end before max_new_tokens, besides its stop tokens and strings: nobody waits
for it any more (`Abandoned`), or the show rule has cut every row (`StopAtUnsure`). transformers stopping criteria,
for `tasks.core.generate`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import PreTrainedModel, StoppingCriteria, StoppingCriteriaList


class Abandoned(StoppingCriteria):
    """Ends every row at the next token once nobody waits for the answer (the client hung up)."""

    def __init__(self, abandoned: Callable[[], bool]):
        self.abandoned = abandoned

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.abandoned(), dtype=torch.bool, device=input_ids.device)


class StopAtUnsure(StoppingCriteria):
    """Ends a row at its first unsure token under the show rule: `tasks.core.generate` cuts the suggestion before
    that token, so nothing the model would write after it is shown or logged, and a batch ends once every row is cut
    or stopped instead of running on to max_new_tokens. Its log-probs are the rule's (the raw logits at
    its temperature, as generate's cut compares them), from a hook on the output layer (`watching`), not from the
    sampling's processed scores."""

    def __init__(self, min_logprob: float, temperature: float):
        self.min_logprob, self.temperature = min_logprob, temperature  # the rule's (`tasks.core.generate.ShowRule`)
        self.step: torch.Tensor | None = None  # the last forward's raw logits at the last position, (B, V)

    @contextlib.contextmanager
    def watching(self, model: PreTrainedModel) -> Iterator[StoppingCriteriaList]:
        def keep(_module: Any, _inputs: Any, output: Any) -> None:
            self.step = output[:, -1, :].detach()

        hook = model.get_output_embeddings().register_forward_hook(keep)
        try:
            yield StoppingCriteriaList([self])
        finally:
            hook.remove()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        assert self.step is not None, "no forward seen: watching() hooks the model's output layer"
        logps = torch.log_softmax(self.step.float() / self.temperature, dim=-1)
        chosen = logps.gather(-1, input_ids[:, -1:].to(logps.device)).squeeze(-1)
        return (chosen < self.min_logprob).to(input_ids.device)
