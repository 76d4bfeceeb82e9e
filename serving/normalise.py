"""An editor's completion request -> what the router takes: one prompt in any FIM template (or prefix +
suffix, or a plain prompt), the stop list, and sampling within the server's limits. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from serving.errors import ApiError
from serving.log import suffix_form_prompt
from serving.protocol import CompletionRequest
from serving.router import FimRequest
from tasks.core.config import ServingParams
from tasks.core.fim import TEMPLATES, FimFormatError, FimPrompt, parse_any
from tasks.core.generate import show_rule

MAX_STOP_STRINGS = 32


@dataclass(frozen=True)
class CompletionInputs:
    """A completion request as the router takes it, and the prompt the editor's outcomes will quote."""

    request: FimRequest
    client_prompt: str  # the editor's prompt (prefix + suffix: their Qwen rendering), the key outcomes match on


def check_size(field: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise ApiError(413, f"{field} is {len(text)} characters; the limit is {limit}", field)


def normalise_request(req: CompletionRequest, s: ServingParams, explore: bool = False) -> CompletionInputs:
    """What an editor sent -> what the router takes: one prompt (a one-element list is fine), parsed in any
    FIM template tabrl knows, or given as prefix (prompt) + suffix, or a plain prompt (no FIM marker: a prefix
    with an empty suffix, as any OpenAI completions client sends); the stop list, and sampling within the
    server's limits; explore: cut at serving.explore_min_logprob. Pure: raises ApiError (400, 413, 422)
    naming the field (400: a prompt that starts a FIM template and breaks it)."""
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:
            raise ApiError(422, f"prompt: send one prompt per request (got a list of {len(req.prompt)})", "prompt")
        text = req.prompt[0]
    else:
        text = req.prompt
    check_size("prompt", text, s.max_prompt_chars)
    if req.suffix is not None or not any(t.marks(text) for t in TEMPLATES.values()):
        # prefix + suffix, or a plain OpenAI completion (no FIM marker, no suffix): the prefix, nothing after it
        suffix = req.suffix or ""
        check_size("suffix", suffix, s.max_prompt_chars)
        source, fim, client_prompt = None, FimPrompt(text, suffix), suffix_form_prompt(text, suffix)
    else:
        try:
            source, fim = parse_any(text)
        except FimFormatError as err:
            raise ApiError(
                400,
                f"{err}; send a FIM prompt in one of {', '.join(TEMPLATES)} "
                "(the prefix-only form: the prefix as prompt plus `suffix`)",
                "prompt",
            ) from None
        client_prompt = text
    stop = [req.stop] if isinstance(req.stop, str) else (list(req.stop) if req.stop else None)
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise ApiError(422, f"stop: at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})", "stop")
    max_tokens = min(req.max_tokens or s.max_tokens, s.max_tokens)  # clients ask for more than a FIM line needs
    temperature = s.temperature if req.temperature is None else req.temperature
    top_p = s.top_p if req.top_p is None else req.top_p
    return CompletionInputs(
        FimRequest(fim, source, stop, max_tokens, temperature, top_p, show_rule(s, explore), req.seed), client_prompt
    )
