"""A model version that is a LoRA adapter on a named base, instead of a full checkpoint.

An adapter version is a directory holding:

* PEFT's files: ``adapter_config.json`` and ``adapter_model.safetensors`` (what vLLM's
  ``/v1/load_lora_adapter`` and ``PeftModel.from_pretrained`` read);
* ``fim_template.json``: the base's FIM template (the adapter speaks its base's format);
* ``tabrl_base.json``: the identity of the base it was trained on, ``BaseRecord``: the sha256 of
  the base checkpoint's weights (what makes it *that* base) and where it was found (a hint).

A base is named by the sha256 of its weight files, so an adapter is never applied to another base,
whatever the directory is called: training, registering, serving and promoting check it
(``check_base``) and refuse with a message that says which bases differ.

    record = read_base(adapter_dir)           # BaseRecord(sha256=..., path=...)
    check_base(adapter_dir, base_dir)         # AdapterBaseError when base_dir is another model
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: its presence makes a directory an adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "tabrl_base.json"
HASH_CHUNK = 1 << 22


class AdapterBaseError(ValueError):
    """An adapter used with a base it was not trained on, or without its base record; the message says which."""


@dataclass(frozen=True)
class BaseRecord:
    sha256: str
    """sha256 of the base checkpoint's weight files (``checkpoint_sha256``): the base's identity."""
    path: str
    """Where the base was when the adapter was trained: a hint for loading on that machine, never an identity."""


def is_adapter(path: str | Path) -> bool:
    """Does path hold a PEFT adapter (rather than a full checkpoint)?"""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def weight_files(checkpoint: Path) -> list[Path]:
    """The weight files of a full checkpoint (one safetensors file, or the shards), in name order."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise AdapterBaseError(f"{checkpoint} holds no *.safetensors weights: not a base checkpoint")
    return files


def checkpoint_sha256(checkpoint: str | Path) -> str:
    """The identity of a full checkpoint: sha256 over its weight files' names and bytes. Hashing a 7B model
    reads ~15 GB, so each file's digest is remembered in this process by (path, size, mtime)."""
    checkpoint = Path(checkpoint)
    if is_adapter(checkpoint):
        raise AdapterBaseError(f"{checkpoint} is an adapter, not a base checkpoint")
    total = hashlib.sha256()
    for file in weight_files(checkpoint):
        total.update(file.name.encode())
        total.update(file_sha256(file).encode())
    return total.hexdigest()


def file_sha256(file: str | Path) -> str:
    """sha256 of a file's bytes, remembered in this process while its size and mtime stay the same."""
    stat = Path(file).stat()
    return _file_sha256(str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_base(adapter_dir: str | Path, base_dir: str | Path) -> BaseRecord:
    """Record base_dir as the adapter's base (its sha256 and its absolute path)."""
    record = BaseRecord(sha256=checkpoint_sha256(base_dir), path=str(Path(base_dir).resolve()))
    (Path(adapter_dir) / BASE_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


def read_base(adapter_dir: str | Path) -> BaseRecord:
    """The base an adapter was trained on; AdapterBaseError when the record is missing or unreadable."""
    path = Path(adapter_dir) / BASE_FILE
    if not path.is_file():
        raise AdapterBaseError(
            f"adapter {adapter_dir} has no {BASE_FILE}: tabrl cannot tell which base it belongs to "
            "(adapters trained by `tabrl train` record it)"
        )
    try:
        return BaseRecord(**json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        raise AdapterBaseError(f"{path} is not a base record ({err})") from err


def check_base(adapter_dir: str | Path, base_dir: str | Path, doing: str = "use") -> BaseRecord:
    """The adapter's base record, once base_dir is shown to be that base (same weights); else AdapterBaseError
    saying why the adapter cannot be used there (`doing`: what was about to happen, for the message)."""
    record = read_base(adapter_dir)
    found = checkpoint_sha256(base_dir)
    if found != record.sha256:
        raise AdapterBaseError(
            f"cannot {doing} adapter {adapter_dir} on base {base_dir}: it was trained on another base "
            f"(weights sha256 {record.sha256[:12]}, at {record.path} when trained) and {base_dir} has sha256 "
            f"{found[:12]}; a LoRA adapter only means something on the weights it was trained on"
        )
    return record


def base_dir_of(adapter_dir: str | Path, base_dir: str | Path | None = None) -> Path:
    """The checkpoint to load an adapter on: base_dir when given, else the path its record names; checked to be
    the adapter's base either way."""
    chosen = Path(base_dir) if base_dir is not None else Path(read_base(adapter_dir).path)
    if not (chosen / "config.json").is_file():
        raise AdapterBaseError(
            f"the base of adapter {adapter_dir} is not at {chosen} (no config.json); pass the base checkpoint "
            "directory explicitly"
        )
    check_base(adapter_dir, chosen, "load")
    return chosen


def adapter_rank(adapter_dir: str | Path) -> int:
    """The LoRA rank r of an adapter (vLLM refuses one above its --max-lora-rank)."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    return int(config["r"])


def adapter_bytes(adapter_dir: str | Path) -> int:
    """Bytes of an adapter directory's files (what the registry stores per version)."""
    return sum(p.stat().st_size for p in Path(adapter_dir).iterdir() if p.is_file())
