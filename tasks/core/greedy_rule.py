"""The show rule of a greedy request served by vLLM, at the rule's temperature.

The gate types greedily and cuts each suggestion at its first token whose log-prob at the serving temperature
is below serving.min_logprob (`tasks.core.generate.ShowRule`), as the served model, which samples at that
temperature, is cut. vLLM returns a greedy request's log-probs at T = 1 (its sampler skips the temperature), so
the evaluation engine asks for each position's top-k and `rule_logprobs` rescales them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

GREEDY_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


def rule_logprobs(logprobs: Sequence[float], top: Sequence[dict[str, float] | None], temperature: float) -> list[float]:
    """Log-probs at `temperature` (below 1) of greedily chosen tokens, from vLLM's log-probs at T = 1 and each
    position's top-k: a greedy request's processed log-probs are at T = 1 (vLLM's sampler skips the temperature),
    while the show rule compares them at the serving temperature, as in process. The tokens outside the top-k
    (mass m, none above the k-th p_k) add at most m * p_k ** (1/T - 1) to the normaliser, which is counted, so a
    log-prob here is never above the exact one: the cut is as strict, or (where the tail is not negligible)
    stricter."""
    if not 0 < temperature < 1:
        raise ValueError(f"a greedy show rule at T = {temperature} is computed by vLLM itself (T = 1) or not at all")
    out = []
    for chosen, options in zip(logprobs, top, strict=True):
        values = list((options or {}).values())
        if not any(abs(v - chosen) < 1e-9 for v in values):
            values.append(chosen)  # a token string shared by two ids collapses in the JSON map
        terms = [(v - chosen) / temperature for v in values]  # log of p_v ** (1/T) / p_chosen ** (1/T)
        tail_mass = 1.0 - sum(math.exp(v) for v in values)
        if tail_mass > 0:
            terms.append(math.log(tail_mass) + (1 / temperature - 1) * min(values) - chosen / temperature)
        top_term = max(terms)
        out.append(-(top_term + math.log(sum(math.exp(t - top_term) for t in terms))))
    return out
