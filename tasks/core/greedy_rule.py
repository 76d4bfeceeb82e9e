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


def rule_logprobs(
    logprobs: Sequence[float], top: Sequence[dict[str, float] | None], temperature: float, vocab_size: int = 0
) -> list[float]:
    """Log-probs at `temperature` of greedily chosen tokens, from vLLM's log-probs at T = 1 and each position's
    top-k: a greedy request's processed log-probs are at T = 1 (vLLM's sampler skips the temperature), while the
    show rule compares them at the serving temperature, as in process. The tokens outside the top-k (mass m)
    add at most a bound to the normaliser, which is counted, so a log-prob here is never above the exact one:
    the cut is as strict, or (where the tail is not negligible) stricter. Below T = 1, none of them is above the
    k-th p_k, so they add at most m * p_k ** (1/T - 1); above it, p ** (1/T) is concave, so they add most when the
    mass is spread evenly over the n tail tokens, n * (m / n) ** (1/T), which needs vocab_size (the model's)."""
    if temperature <= 0:
        raise ValueError(f"a show rule at T = {temperature}: the temperature must be above 0")
    if temperature == 1:
        return [float(lp) for lp in logprobs]  # vLLM's own
    if temperature > 1 and vocab_size <= 0:
        raise ValueError(f"a greedy show rule at T = {temperature} (above 1) bounds the tail by the vocabulary's size")
    out = []
    for chosen, options in zip(logprobs, top, strict=True):
        values = list((options or {}).values())
        if not any(abs(v - chosen) < 1e-9 for v in values):
            values.append(chosen)  # a token string shared by two ids collapses in the JSON map
        terms = [(v - chosen) / temperature for v in values]  # log of p_v ** (1/T) / p_chosen ** (1/T)
        tail_mass = 1.0 - sum(math.exp(v) for v in values)
        n_tail = vocab_size - len(values) if vocab_size else None  # None: unknown, which below T = 1 needs not
        if tail_mass > 0 and n_tail != 0:
            terms.append(_tail_term(tail_mass, min(values), temperature, n_tail or 1) - chosen / temperature)
        top_term = max(terms)
        out.append(-(top_term + math.log(sum(math.exp(t - top_term) for t in terms))))
    return out


def _tail_term(mass: float, lowest: float, temperature: float, n_tail: int) -> float:
    """log of the most the tail's tokens (total probability `mass`, none above exp(lowest)) add to the sum of
    p ** (1/T)."""
    if temperature < 1:
        return math.log(mass) + (1 / temperature - 1) * lowest
    return (1 - 1 / temperature) * math.log(n_tail) + math.log(mass) / temperature
