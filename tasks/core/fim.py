"""FIM prompt templates as data: one table, used by serving, training and evaluation alike.

A template says how a model family wants the text around the cursor: its markers, their order
(prefix-suffix-middle, suffix-prefix-middle, or the prefix alone for a model without FIM), the
string that ends a middle (an empty middle is that string right after the prompt: "no
suggestion"), the stop strings, and the repo-level context markers. Qwen2.5-Coder's, for example:

    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>

and its repo-level form puts ``<|repo_name|>{repo}\\n<|file_sep|>{path}\\n{content}...`` before the
final ``<|fim_prefix|>``; that context is kept verbatim (``FimPrompt.context``) and re-rendered with
another family's markers when another family serves it.

A model's template travels with its checkpoint (``fim_template.json``, see ``tasks.core.generate``);
``infer_template`` finds it from the tokenizer's special tokens when the file is absent, and
``template_for_model_name`` from a model name as Continue does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Order = Literal["psm", "spm", "prefix-only"]
TEMPLATE_FILE = "fim_template.json"


class FimFormatError(ValueError):
    """A prompt that is not in the expected template; the message says what is missing."""


@dataclass(frozen=True)
class FimPrompt:
    prefix: str
    suffix: str
    context: str = ""
    """Everything before the prompt's first FIM marker (repo-level context), verbatim."""


@dataclass(frozen=True)
class FimTemplate:
    name: str
    order: Order
    prefix: str
    """Marker before the prefix ("" for prefix-only)."""
    suffix: str
    """Marker before the suffix ("" for prefix-only)."""
    middle: str
    """Marker after which the model writes the middle ("" where the order has none)."""
    end: str
    """What ends a middle; an empty middle is this right after the prompt. "" = the tokenizer's EOS."""
    stops: tuple[str, ...]
    """Where a completion ends (Continue's stop list for the family)."""
    repo_name: str = ""
    """Repo-level context markers ("" where the family has none)."""
    file_sep: str = ""
    continue_models: str = ""
    """The model names for which Continue picks this template (documentation)."""

    def render(self, prefix: str, suffix: str, context: str = "") -> str:
        """The prompt the model sees; the suffix is dropped by prefix-only templates."""
        if self.order == "spm":
            return f"{context}{self.suffix}{suffix}{self.prefix}{prefix}{self.middle}"
        if self.order == "prefix-only":
            return f"{context}{prefix}"
        return f"{context}{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"

    def training_text(self, prefix: str, suffix: str, middle: str, eos: str) -> str:
        """A full training sample: prompt, middle, end (eos is the tokenizer's, used when ``end`` is "")."""
        return self.render(prefix, suffix) + middle + (self.end or eos)

    def marks(self, prompt: str) -> bool:
        """Does the prompt carry this template's leading marker?"""
        first = self.suffix if self.order == "spm" else self.prefix
        return bool(first) and first in prompt

    def parse(self, prompt: str) -> FimPrompt:
        """Split a prompt in this template into context, prefix and suffix (FimFormatError if it is not)."""
        if self.order == "prefix-only":
            return FimPrompt(prefix=prompt, suffix="")
        first, second = (self.suffix, self.prefix) if self.order == "spm" else (self.prefix, self.suffix)
        start = prompt.rfind(first)
        if start < 0:
            raise FimFormatError(f"prompt has no {first} marker ({self.name})")
        head, sep, rest = prompt[start + len(first) :].partition(second)
        if not sep:
            raise FimFormatError(f"prompt has no {second} after {first} ({self.name})")
        if self.middle:
            tail_text, sep, tail = rest.partition(self.middle)
            if not sep:
                raise FimFormatError(f"prompt has no {self.middle} after {second} ({self.name})")
            if tail:
                raise FimFormatError(
                    f"prompt must end with {self.middle} ({self.name}), found {len(tail)} characters after it"
                )
        else:
            tail_text = rest
        prefix, suffix = (tail_text, head) if self.order == "spm" else (head, tail_text)
        return FimPrompt(prefix=prefix, suffix=suffix, context=prompt[:start])

    def translate_context(self, context: str, into: FimTemplate) -> str:
        """Repo-level context in this template's markers -> the same in another's ("" if it has none)."""
        if not context or into == self:
            return context
        if not (into.repo_name and into.file_sep and self.repo_name and self.file_sep):
            return ""  # a family without repo-level markers would read ours as text
        return context.replace(self.repo_name, into.repo_name).replace(self.file_sep, into.file_sep)

    def rerender(self, fim: FimPrompt, source: FimTemplate | None) -> str:
        """A prompt parsed from ``source`` (None: given as prefix + suffix) rendered in this template."""
        context = source.translate_context(fim.context, self) if source is not None else fim.context
        return self.render(fim.prefix, fim.suffix, context)

    @property
    def keeps_first_token(self) -> bool:
        """When a prompt is too long, keep its first token (a FIM marker) and drop the oldest after it."""
        return self.order != "prefix-only"


QWEN_STOPS = (
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|im_start|>",
    "<|im_end|>",
)

QWEN = FimTemplate(
    name="qwen2.5-coder",
    order="psm",
    prefix="<|fim_prefix|>",
    suffix="<|fim_suffix|>",
    middle="<|fim_middle|>",
    end="<|endoftext|>",
    stops=QWEN_STOPS,
    repo_name="<|repo_name|>",
    file_sep="<|file_sep|>",
    continue_models='"qwen" and "coder" in the name (plain and repo-level prompts)',
)
STARCODER = FimTemplate(
    name="starcoder",
    order="psm",
    prefix="<fim_prefix>",
    suffix="<fim_suffix>",
    middle="<fim_middle>",
    end="<|endoftext|>",
    stops=("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>", "<file_sep>", "<repo_name>"),
    repo_name="<repo_name>",
    file_sep="<file_sep>",
    continue_models='"starcoder", "star-coder", "stable-code" (StarCoder, StarCoder2, StableCode)',
)
DEEPSEEK = FimTemplate(
    name="deepseek-coder",
    order="psm",
    prefix="<｜fim▁begin｜>",
    suffix="<｜fim▁hole｜>",
    middle="<｜fim▁end｜>",
    end="<｜end▁of▁sentence｜>",
    stops=("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<END>", "<｜end▁of▁sentence｜>"),
    continue_models='"deepseek"',
)
CODELLAMA = FimTemplate(
    name="codellama",
    order="psm",
    prefix="<PRE> ",
    suffix=" <SUF>",
    middle=" <MID>",
    end=" <EOT>",
    stops=("<PRE>", "<SUF>", "<MID>", "<EOT>"),
    continue_models='"codellama"',
)
CODESTRAL = FimTemplate(
    name="codestral",
    order="spm",
    prefix="[PREFIX]",
    suffix="[SUFFIX]",
    middle="",
    end="</s>",
    stops=("[PREFIX]", "[SUFFIX]", "</s>"),
    continue_models='"codestral"',
)
CODEGEMMA = FimTemplate(
    name="codegemma",
    order="psm",
    prefix="<|fim_prefix|>",
    suffix="<|fim_suffix|>",
    middle="<|fim_middle|>",
    end="<|file_separator|>",
    stops=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>", "<end_of_turn>", "<eos>"),
    continue_models='"codegemma"',
)
PREFIX_ONLY = FimTemplate(
    name="prefix-only",
    order="prefix-only",
    prefix="",
    suffix="",
    middle="",
    end="",
    stops=("\n",),  # a left-to-right model does not know the suffix: one line at a time
    continue_models="any other model (no FIM tokens): the prefix alone",
)

# Parse order: the first template whose leading marker a prompt carries wins (CodeGemma shares
# Qwen's markers; either parse gives the same prefix and suffix).
TEMPLATES: dict[str, FimTemplate] = {
    t.name: t for t in (QWEN, STARCODER, DEEPSEEK, CODELLAMA, CODESTRAL, CODEGEMMA, PREFIX_ONLY)
}


def get_template(name: str) -> FimTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise FimFormatError(f"unknown FIM template {name!r}; known: {', '.join(TEMPLATES)}") from None


def parse_any(prompt: str) -> tuple[FimTemplate, FimPrompt]:
    """(template, parts) of a prompt in any FIM template of the table; FimFormatError naming them if none."""
    for template in TEMPLATES.values():
        if template.marks(prompt):
            return template, template.parse(prompt)
    known = ", ".join(t.name for t in TEMPLATES.values() if t.order != "prefix-only")
    raise FimFormatError(f"prompt is in no FIM template tabrl knows ({known})")


def template_for_model_name(model: str) -> FimTemplate | None:
    """The template Continue would choose for a model name, or None when the name says nothing."""
    name = model.lower()
    if "qwen" in name and "coder" in name:
        return QWEN
    rules = (
        (("starcoder", "star-coder", "stable-code"), STARCODER),
        (("deepseek",), DEEPSEEK),
        (("codellama", "code-llama"), CODELLAMA),
        (("codestral",), CODESTRAL),
        (("codegemma",), CODEGEMMA),
    )
    for needles, template in rules:
        if any(n in name for n in needles):
            return template
    return None


def infer_template(special_tokens: set[str]) -> FimTemplate:
    """A tokenizer's template from its special tokens: the family whose markers and end it has, else prefix-only."""
    # CodeGemma before Qwen: same FIM markers, told apart by the end token.
    for template in (CODEGEMMA, QWEN, STARCODER, DEEPSEEK, CODESTRAL, CODELLAMA):
        needed = {m.strip() for m in (template.prefix, template.suffix, template.middle, template.end) if m.strip()}
        if needed <= special_tokens:
            return template
    return PREFIX_ONLY


def save_template(model_dir: str | Path, template: FimTemplate) -> Path:
    """Record a checkpoint's template beside its weights (travels with every registered version)."""
    path = Path(model_dir) / TEMPLATE_FILE
    path.write_text(json.dumps(asdict(template), indent=2, ensure_ascii=False) + "\n")
    return path


def read_template(model_dir: str | Path) -> FimTemplate | None:
    """The template recorded with a checkpoint, or None when it has none; a bad file is an error."""
    path = Path(model_dir) / TEMPLATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["stops"] = tuple(data["stops"])
        return FimTemplate(**data)
    except (ValueError, TypeError, KeyError) as err:
        raise FimFormatError(
            f"{path} is not a FIM template ({err}); delete it (the template is then inferred) or re-import the model"
        ) from err


def cut_at_stop(text: str, stops: tuple[str, ...] | list[str]) -> str:
    """The generated text up to the first stop string (not included)."""
    cut = len(text)
    for stop in stops:
        if stop:
            at = text.find(stop)
            if 0 <= at < cut:
                cut = at
    return text[:cut]


def parse_completion(text: str, stops: tuple[str, ...] | list[str]) -> str:
    """The suggestion shown to the user; "" means abstain (nothing shown)."""
    middle = cut_at_stop(text, stops)
    return "" if not middle.strip() else middle


# The tiny base's vocabulary is Qwen's special tokens, ids in this order after the byte alphabet.
SPECIAL_TOKENS = QWEN_STOPS
