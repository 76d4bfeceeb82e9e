"""Load a Hugging Face checkpoint and complete FIM prompts, keeping token ids and log-probs.

One code path for the tiny model, an imported checkpoint (`tabrl import-model`) and a local
Qwen2.5-Coder directory; each model's FIM template comes with it (``model_template``). Log-probs are those of
the sampled tokens under the distribution actually sampled from: logits / temperature (greedy
decoding reports temperature 1). The stop token that ended a completion is kept in ``token_ids``
(stopping is an action the policy learns), never in ``text``.

A ``ShowRule`` shows a suggestion only up to the model's first unsure token (``cut_unsure``): the same
rule, on the same log-probs, in the gateway's embedded and vLLM arms and in the held-out evaluation. In process, a
row's generation also ends at that token (``tasks.core.stopping``): nothing after it is shown or logged, so a batch
stops once every row is cut or stopped (a gate's typing of tabrl-tiny: 48 forwards instead of 403, the same answers).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteriaList,
)

from tasks.core.adapters import ADAPTER_WEIGHTS, base_dir_of, file_sha256, is_adapter
from tasks.core.config import ServingParams
from tasks.core.fim import FimTemplate, infer_template, parse_completion, read_template, save_template
from tasks.core.stopping import Abandoned, StopAtUnsure


class ModelLoadError(ValueError):
    """A model directory that is missing or not a Hugging Face causal-LM checkpoint."""


@dataclass
class Generation:
    text: str  # the suggestion shown ("" = abstain)
    token_ids: list[int]  # sampled completion tokens, the stop token included when one was emitted
    logprobs: list[float]  # log-prob of each token in token_ids under the sampling distribution
    raw_text: str = ""  # the decoded tokens before stop handling
    latency_ms: float = 0.0
    finish_reason: str = field(default="stop")  # "stop" | "length"
    prompt_tokens: int | None = None  # tokens of the prompt the model read (None: the backend did not say)


@dataclass(frozen=True)
class ShowRule:
    """Cut a suggestion before its first shown token whose log-prob under logits / temperature is below
    min_logprob; nothing left: no suggestion. temperature is the serving temperature, so a sampled arm's
    logged log-probs are the ones compared, and a greedy evaluation applies the rule the served model does.
    The tokens kept are logged as the completion (no stop token: the row trains like a length-cut one)."""

    min_logprob: float
    temperature: float

    def first_unsure(self, logprobs: Sequence[float], stopped: bool) -> int | None:
        """Index of the first shown token below min_logprob, or None. The stop token that ended a completion
        (its last, when stopped) shows nothing and never cuts."""
        shown = len(logprobs) - 1 if stopped else len(logprobs)
        return next((i for i in range(shown) if logprobs[i] < self.min_logprob), None)


def show_rule(serving: ServingParams, explore: bool = False) -> ShowRule | None:
    """The rule serving.min_logprob names at serving.temperature (None: show every suggestion whole); greedy
    serving compares at T = 1. explore: an exploring request's looser cut (serving.explore_min_logprob)."""
    threshold = serving.explore_min_logprob if explore else serving.min_logprob
    if threshold is None:
        return None
    return ShowRule(threshold, serving.temperature if serving.temperature > 0 else 1.0)


def describe_rule(rule: ShowRule | None, key: str = "serving.min_logprob") -> str:
    """One line saying what users are shown (for the gateway's and the evaluation's output); key: the param
    that set the rule's threshold."""
    if rule is None:
        return f"suggestions shown whole ({key}: null)"
    return (
        f"suggestions shown up to the first token with log-prob < {rule.min_logprob:g} "
        f"at T = {rule.temperature:g} ({key})"
    )


def cut_unsure(gen: Generation, keep: int, raw: str, stops: Sequence[str]) -> Generation:
    """gen cut to its first keep tokens, raw being their text (what the backend decoded them to)."""
    return Generation(
        text=parse_completion(raw, tuple(stops)),
        token_ids=gen.token_ids[:keep],
        logprobs=gen.logprobs[:keep],
        raw_text=raw,
        latency_ms=gen.latency_ms,
        finish_reason="stop",
        prompt_tokens=gen.prompt_tokens,
    )


def check_model_dir(path: str | Path) -> Path:
    """path, if it holds a checkpoint (config.json) or a LoRA adapter; else ModelLoadError naming it. Loads nothing."""
    path = Path(path)
    if not (path / "config.json").is_file() and not is_adapter(path):
        raise ModelLoadError(
            f"{path} is not a model directory (no config.json); build it with `make demo` or `dvc repro base`"
        )
    return path


class LoadedModel(NamedTuple):
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    template: FimTemplate


def load_model(
    path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, base_dir: str | Path | None = None
) -> LoadedModel:
    """(model, tokenizer, FIM template) from a local checkpoint directory, or from a LoRA adapter version on its
    base (base_dir, default: the path the adapter records; checked to be its base), merged into the base's
    weights in memory: one model to run, at the speed of the base. Never downloads."""
    if is_adapter(path):
        return _load_merged(Path(path), base_dir_of(path, base_dir), device, dtype)
    path = check_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device).eval()
    return LoadedModel(model, tokenizer, model_template(path, tokenizer))


def _load_merged(adapter: Path, base: Path, device: str, dtype: torch.dtype) -> LoadedModel:
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=dtype)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.to(device).eval()
    return LoadedModel(model, tokenizer, model_template(adapter, tokenizer))


def merged_dir(adapter_dir: str | Path, models_dir: str | Path) -> Path:
    """Where an adapter version merged into its base is kept: one directory per adapter's weights, shared by a
    merged arm (serving.adapter_serving: merged) and an evaluation typing it merged (evaluate.adapter_engine)."""
    return Path(models_dir) / "merged" / file_sha256(Path(adapter_dir) / ADAPTER_WEIGHTS)[:16]


def save_merged(adapter_dir: str | Path, base_dir: str | Path | None, out: Path) -> Path:
    """An adapter version merged into its base, saved as a full checkpoint at out (`tabrl export --merged`, and
    vLLM arms with serving.adapter_serving: merged); kept, since merging again gives the same weights."""
    if (out / "config.json").is_file():
        return out
    lm = load_model(adapter_dir, base_dir=base_dir)
    tmp = out.with_name(out.name + ".merging")
    shutil.rmtree(tmp, ignore_errors=True)
    lm.model.save_pretrained(tmp)
    lm.tokenizer.save_pretrained(tmp)
    save_template(tmp, lm.template)
    tmp.rename(out)
    return out


def model_template(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> FimTemplate:
    """A checkpoint's FIM template: the one recorded with it, else inferred from its tokenizer's special tokens."""
    recorded = read_template(path)
    if recorded is not None:
        return recorded
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(check_model_dir(path), local_files_only=True)
    return infer_template(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()))


def stops_of(template: FimTemplate, tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The template's stop strings plus the tokenizer's end of text (a model always may stop)."""
    eos = tokenizer.eos_token
    return template.stops + ((eos,) if eos and eos not in template.stops else ())


def split_stops(tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> tuple[list[int], list[str]]:
    """(ids of the stop strings that are single tokens of this vocabulary, EOS always among them; the other,
    plain-text stop strings). One vocabulary read: a 49k vocabulary is a dict built per call."""
    vocab = tokenizer.get_vocab()
    ids = [vocab[s] for s in stops if s in vocab]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids, [s for s in stops if s and s not in vocab]


def fit_prompt(ids: list[int], limit: int, keep_first: bool = True) -> list[int]:
    """Prompt ids within limit tokens, dropping the oldest; keep_first keeps a leading FIM or repo marker."""
    if len(ids) <= limit:
        return ids
    if not keep_first:
        return ids[len(ids) - limit :]
    return ids[:1] + ids[len(ids) - limit + 1 :]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, limit: int, template: FimTemplate) -> list[int]:
    """The prompt ids a model sees, identical at serving and training time. An empty prompt (a prefix-only
    model at the top of a file) is the start-of-text token alone: a model cannot continue nothing."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [start]
    return fit_prompt(ids, limit, template.keeps_first_token)


def cut_tokens_at_text_stop(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], text_stops: Sequence[str]
) -> tuple[list[int], bool]:
    """(ids up to and including the token that completes a plain-text stop string, whether one did).
    That token is the stop action; what the model wrote after it was never shown and is not kept."""
    full = tokenizer.decode(ids, skip_special_tokens=False)
    if not any(s in full for s in text_stops):
        return ids, False
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        if any(s in text for s in text_stops):
            return ids[:n], True
    return ids, False


def prompt_limit(model: PreTrainedModel, max_new_tokens: int) -> int:
    return model.config.max_position_embeddings - max_new_tokens


def _left_padded(encoded: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) token ids and attention mask, each prompt at the right end of its row."""
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    return input_ids, attention


def _logps_at(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, new) log-probs of `tokens` under (B, new, V) `logits` at `temperature`."""
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _row_generation(
    tokenizer: PreTrainedTokenizerBase,
    new_ids: list[int],
    new_logps: list[float],
    stop_set: set[int],
    text_stops: Sequence[str],
    stop: Sequence[str],
    latency_ms: float,
) -> Generation:
    """One row's tokens up to its first stop token or plain-text stop, decoded and parsed."""
    ids, lps = [], []
    finish = "length"
    for tok, lp in zip(new_ids, new_logps, strict=True):
        ids.append(tok)
        lps.append(lp)
        if tok in stop_set:
            finish = "stop"
            break
    ids, text_stopped = cut_tokens_at_text_stop(tokenizer, ids, text_stops)
    if text_stopped:
        lps, finish = lps[: len(ids)], "stop"
    raw = tokenizer.decode([t for t in ids if t not in stop_set], skip_special_tokens=False)
    return Generation(
        text=parse_completion(raw, tuple(stop)),
        token_ids=ids,
        logprobs=lps,
        raw_text=raw,
        latency_ms=latency_ms,
        finish_reason=finish,
    )


def _sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stops: list[int],
    pad_id: int,
    text_stops: Sequence[str],
    abandoned: Callable[[], bool] | None = None,
    streamer: Any = None,
    rule: ShowRule | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF generate on the left-padded batch: the (B, new) new tokens and their (B, new, V) logits, on the CPU.
    A row ends at its first stop token, plain-text stop (a newline for a prefix-only model; its tokens are cut
    later), unsure token under `rule`, or when `abandoned` says so."""
    width = input_ids.shape[1]
    device = next(model.parameters()).device
    sample = temperature > 0
    text_stop_kw: dict = {"stop_strings": text_stops, "tokenizer": tokenizer} if text_stops else {}
    with contextlib.ExitStack() as stack:
        criteria = StoppingCriteriaList()
        if rule is not None:
            criteria = stack.enter_context(StopAtUnsure(rule.min_logprob, rule.temperature).watching(model))
        if abandoned is not None:
            criteria.append(Abandoned(abandoned))
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=None,
            eos_token_id=stops,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            streamer=streamer,
            stopping_criteria=criteria,
            **text_stop_kw,
        )
    new_tokens = out.sequences[:, width:].cpu()
    return new_tokens, torch.stack(out.logits, dim=1).float().cpu()  # (B, new), (B, new, V)


def _shown_part(
    gen: Generation, rule: ShowRule, rule_logps: torch.Tensor, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]
) -> Generation:
    """The suggestion cut at its first unsure token under the show rule (whole when none is unsure)."""
    ids = gen.token_ids
    unsure = rule.first_unsure(rule_logps[: len(ids)].tolist(), gen.finish_reason == "stop")
    if unsure is None:
        return gen
    return cut_unsure(gen, unsure, tokenizer.decode(ids[:unsure], skip_special_tokens=False), stop)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    template: FimTemplate,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    rule: ShowRule | None = None,
    abandoned: Callable[[], bool] | None = None,
    streamer: Any = None,
) -> list[Generation]:
    """Complete a batch of prompts in the model's template (left-padded); greedy when temperature == 0.
    stop: the request's stop strings (default: the template's, with the tokenizer's EOS); rule: cut each
    suggestion at its first unsure token; abandoned: asked after every token, True ends the generation there
    (what it made so far comes back, cut like a length-limited one); streamer: told of each token of one prompt
    as it comes (`tasks.core.streaming.feed`)."""
    if not prompts:
        return []
    started = time.perf_counter()
    stop = tuple(stop) if stop is not None else stops_of(template, tokenizer)
    stops, text_stops = split_stops(tokenizer, stop)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    limit = prompt_limit(model, max_new_tokens)
    encoded = [encode_prompt(tokenizer, p, limit, template) for p in prompts]
    input_ids, attention = _left_padded(encoded, pad_id)
    if seed is not None:
        torch.manual_seed(seed)
    new_tokens, logits = _sample(
        model,
        tokenizer,
        input_ids,
        attention,
        max_new_tokens,
        temperature,
        top_p,
        stops,
        pad_id,
        text_stops,
        abandoned,
        streamer,
        rule,
    )
    scale = temperature if temperature > 0 else 1.0  # greedy: the model's own distribution
    logps = _logps_at(logits, new_tokens, scale)  # (B, new)
    rule_logps = logps if rule is None or rule.temperature == scale else _logps_at(logits, new_tokens, rule.temperature)
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    stop_set = set(stops)
    results = []
    for row in range(len(prompts)):
        latency = elapsed_ms / len(prompts)
        gen = _row_generation(
            tokenizer, new_tokens[row].tolist(), logps[row].tolist(), stop_set, text_stops, stop, latency
        )
        gen = replace(gen, prompt_tokens=len(encoded[row]))
        results.append(gen if rule is None else _shown_part(gen, rule, rule_logps[row], tokenizer, stop))
    return results
