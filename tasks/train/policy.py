"""The starting weights of an update and how its result is saved: a full checkpoint, or a LoRA adapter.

train.adapter = none: the update changes every weight (but the frozen embeddings) and saves a full
checkpoint, as tabrl-tiny's versions are.

train.adapter = lora: the update trains a PEFT LoRA adapter on the base and saves only the adapter
(``tasks/core/adapters.py``: PEFT's files, the FIM template, the base's identity). From a full checkpoint
a fresh adapter starts (B = 0: the starting policy is the base itself); from an adapter version (the
champion after the first promotion) the update continues that adapter, on the base it records, with
the rank and targets it was made with. Either way the proximal and reference log-probs are those of
the starting weights, base + the champion's adapter, computed by the same module before the first
step; the base alone is one ``disable_adapter()`` away (no second copy), for a KL-to-base term.

    start = load_start(from_dir, base_dir, params.train, attn="sdpa")
    policy = CompletionPolicy(start.lm)          # the LoRA layers are inside start.lm
    ...
    save_start(start, state, out, template, result_json)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tasks.core.adapters import BASE_FILE, base_dir_of, is_adapter, write_base
from tasks.core.config import TrainParams
from tasks.core.fim import FimTemplate, save_template
from tasks.core.generate import model_template

RESULT_FILE = "train_result.json"


class StartError(ValueError):
    """Starting weights that this update cannot start from; the message says why and what to do."""


@dataclass
class Start:
    lm: PreTrainedModel  # the causal LM the update runs (LoRA layers injected in place with an adapter)
    tokenizer: PreTrainedTokenizerBase
    template: FimTemplate
    peft: object | None  # the PeftModel wrapping lm (train.adapter = lora), which saves the adapter
    base_dir: Path | None  # the base checkpoint an adapter is trained on (None: full fine-tuning)

    @property
    def name(self) -> str:
        return "lora" if self.peft is not None else "full"


def lora_config(tp: TrainParams):
    """PEFT's LoraConfig for a fresh adapter (train.lora_*)."""
    from peft import LoraConfig

    targets: str | list[str] = "all-linear" if tp.lora_targets == ("all-linear",) else list(tp.lora_targets)
    return LoraConfig(
        r=tp.lora_rank,
        lora_alpha=tp.lora_alpha,
        lora_dropout=tp.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def load_start(from_dir: str | Path, base_dir: str | Path | None, tp: TrainParams, attn: str = "sdpa") -> Start:
    """The starting weights in fp32: from_dir itself (train.adapter = none), or base + a LoRA adapter, fresh or
    from_dir's (lora). base_dir: the base of an adapter from_dir (default: the path its record names)."""
    from_dir = Path(from_dir)
    starts_from_adapter = is_adapter(from_dir)
    if tp.adapter == "none" and starts_from_adapter:
        raise StartError(
            f"{from_dir} is a LoRA adapter but train.adapter is none: continue it with train.adapter=lora, or merge "
            "it into a full checkpoint first (`tabrl export --merged`)"
        )
    base = base_dir_of(from_dir, base_dir) if starts_from_adapter else from_dir
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    template = model_template(from_dir if starts_from_adapter else base, tokenizer)
    lm = AutoModelForCausalLM.from_pretrained(
        base, local_files_only=True, dtype=torch.float32, attn_implementation=attn
    )
    if tp.adapter == "none":
        return Start(lm, tokenizer, template, None, None)
    from peft import PeftModel, get_peft_model

    if starts_from_adapter:
        peft = PeftModel.from_pretrained(lm, from_dir, is_trainable=True)
    else:
        peft = get_peft_model(lm, lora_config(tp))
    return Start(peft.base_model.model, tokenizer, template, peft, base)


def trainable_names(start: Start) -> set[str] | None:
    """Names (in start.lm) of the parameters a saved result needs: the adapter's (lora), or None for all."""
    if start.peft is None:
        return None
    return {name for name, p in start.lm.named_parameters() if p.requires_grad}


def save_start(start: Start, state: dict[str, torch.Tensor], out: Path, result: dict) -> None:
    """The trained weights (`state`: fp32, named as in start.lm) as a checkpoint or adapter directory with the
    tokenizer (full) or the base record (adapter), the FIM template and train_result.json, written to a temp dir
    and renamed into place (atomic on one filesystem)."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if start.peft is None:
        start.lm.save_pretrained(tmp, state_dict=state)
        start.tokenizer.save_pretrained(tmp)
        # fp32 on disk whatever the compute dtype: lr ~1e-6 updates vanish in bf16 weights
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        # PEFT names the adapter's tensors from the wrapper's point of view; it keeps the lora_* ones itself
        start.peft.save_pretrained(tmp, state_dict={f"base_model.model.{k}": v for k, v in state.items()})
        assert start.base_dir is not None
        write_base(tmp, start.base_dir)
    save_template(tmp, start.template)
    (tmp / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def is_trained_adapter(path: str | Path) -> bool:
    """An adapter directory with its base record (what `save_start` writes for train.adapter = lora)."""
    return is_adapter(path) and (Path(path) / BASE_FILE).is_file()
