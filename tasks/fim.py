"""The one FIM prompt format (Qwen2.5-Coder's), used by serving, training and evaluation alike.

    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>

Continue sends the repo-level form for models named "qwen...coder":
    <|repo_name|>{repo}\n<|file_sep|>{path}\n{content}...<|file_sep|>{path}\n<|fim_prefix|>...
`parse_prompt` accepts both and returns the cursor's prefix and suffix plus the context before.
An empty middle means "no suggestion" (abstain).
"""

from __future__ import annotations

from dataclasses import dataclass

FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_PAD = "<|fim_pad|>"
EOS = "<|endoftext|>"
REPO_NAME = "<|repo_name|>"
FILE_SEP = "<|file_sep|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Order matters for the tokenizer: ids are assigned in this order after the byte alphabet.
SPECIAL_TOKENS = (EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP, IM_START, IM_END)
# Continue's stop list for Qwen coder models; a completion ends at the first of these.
STOP_STRINGS = (EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP, IM_START, IM_END)


class FimFormatError(ValueError):
    """A prompt that is not a FIM prompt; the message says what is missing."""


@dataclass(frozen=True)
class FimPrompt:
    prefix: str
    suffix: str
    context: str = ""
    """Everything before the final <|fim_prefix|> (repo-level context), verbatim."""


def build_prompt(prefix: str, suffix: str, context: str = "") -> str:
    return f"{context}{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}"


def parse_prompt(prompt: str) -> FimPrompt:
    """Split a (plain or repo-level) FIM prompt into context, prefix and suffix."""
    start = prompt.rfind(FIM_PREFIX)
    if start < 0:
        raise FimFormatError(f"prompt has no {FIM_PREFIX} marker")
    rest = prompt[start + len(FIM_PREFIX) :]
    prefix, sep, rest = rest.partition(FIM_SUFFIX)
    if not sep:
        raise FimFormatError(f"prompt has no {FIM_SUFFIX} after {FIM_PREFIX}")
    suffix, sep, tail = rest.partition(FIM_MIDDLE)
    if not sep:
        raise FimFormatError(f"prompt has no {FIM_MIDDLE} after {FIM_SUFFIX}")
    if tail:
        raise FimFormatError(f"prompt must end with {FIM_MIDDLE}, found {len(tail)} characters after it")
    return FimPrompt(prefix=prefix, suffix=suffix, context=prompt[:start])


def cut_at_stop(text: str, stops: tuple[str, ...] | list[str] = STOP_STRINGS) -> str:
    """The generated text up to the first stop string (not included)."""
    cut = len(text)
    for stop in stops:
        if stop:
            at = text.find(stop)
            if 0 <= at < cut:
                cut = at
    return text[:cut]


def parse_completion(text: str, stops: tuple[str, ...] | list[str] = STOP_STRINGS) -> str:
    """The suggestion shown to the user; "" means abstain (nothing shown)."""
    middle = cut_at_stop(text, stops)
    return "" if not middle.strip() else middle


def training_text(prefix: str, suffix: str, middle: str) -> str:
    """A full PSM training sample: prompt, middle, end of text."""
    return build_prompt(prefix, suffix) + middle + EOS
