"""Loading params: params.yaml, then environment, then `--set` overrides (overlay files among them), validated."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from tasks.core.config.base import ParamsError, Section
from tasks.core.config.tree import Params

ENV_PREFIX = "TABRL_"
ENV_ALIASES = {"TABRL_DATABASE_URL": "paths.database_url", "TABRL_MLFLOW_TRACKING_URI": "paths.mlflow_tracking_uri"}
DEFAULT_PARAMS_FILE = Path("params.yaml")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ParamsError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-5` -> ("train.lr", 1e-05); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ParamsError(f"override {text!r} must look like section.key=value, e.g. train.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ParamsError(f"override {text!r}: the value is not valid YAML ({err})") from err
    return key.strip(), value


def overlay_overrides(path: str | os.PathLike[str]) -> list[tuple[str, Any]]:
    """The keys of an overlay file (sections of params.yaml's shape, e.g. params.real-model.yaml) as overrides:
    `--set @params.real-model.yaml` applies all of them where it stands among the other `--set`s."""
    file = Path(path)
    if not file.is_file():
        raise ParamsError(f"overlay {file} not found (`--set @FILE` names a YAML file of params sections)")
    try:
        loaded = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ParamsError(f"overlay {file} is not valid YAML: {err}") from err
    if not isinstance(loaded, dict):
        raise ParamsError(f"overlay {file} must hold a mapping of sections, got {type(loaded).__name__}")
    return list(_flatten_sections(loaded))


def _flatten_sections(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted keys down to the fields of sections (sections nest: evaluate.judge); a field whose value is a
    mapping (fim.span_weights) stays whole, as a `--set` of that key would give it."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and _is_section(dotted):
            yield from _flatten_sections(value, dotted + ".")
        else:
            yield dotted, value


def _is_section(dotted: str) -> bool:
    model: Any = Params
    for part in dotted.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    return isinstance(model, type) and issubclass(model, Section)


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """`TABRL_TRAIN__LR=1e-5` -> ("train.lr", 1e-05); aliases such as TABRL_DATABASE_URL too."""
    found = []
    for name, raw in sorted(environ.items()):
        if name in ENV_ALIASES:
            found.append((ENV_ALIASES[name], raw))
        elif name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            found.append(parse_override(f"{dotted}={raw}"))
    return found


def _describe(err: ErrorDetails, tree: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key (check the spelling; known keys are listed in tasks/core/config/)"
    value = err.get("input")
    return f"{loc} = {value!r}: {err['msg']}"


def load_params(
    path: str | os.PathLike[str] | None = DEFAULT_PARAMS_FILE,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Params:
    """Read params.yaml (or only defaults when path is None), apply env then CLI overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ParamsError(
                f"params file {file} not found (run where one is, write one with `tabrl init`, or pass --params PATH)"
            )
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise ParamsError(f"{file} is not valid YAML: {err}") from err
        if not isinstance(loaded, dict):
            raise ParamsError(f"{file} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    pairs = env_overrides(os.environ if environ is None else environ)
    for text in overrides:
        pairs += overlay_overrides(text[1:]) if text.startswith("@") else [parse_override(text)]
    for dotted, value in pairs:
        _set_dotted(tree, dotted, value)
    try:
        return Params.model_validate(tree)
    except ValidationError as err:
        lines = [_describe(e, tree) for e in err.errors()]
        where = f"{path}" if path is not None else "params"
        raise ParamsError(f"invalid {where}:\n  " + "\n  ".join(lines)) from None
