"""A params tree as a params.yaml a person reads: every section and key, each with the first sentence of its
docstring as a comment (`tabrl init` writes the package's defaults so, outside a checkout)."""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from tasks.core.config.base import Section


def _first_sentence(doc: str | None, limit: int = 100) -> str:
    text = " ".join((doc or "").split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    first = match.group(1) if match else text
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


def params_yaml(params: BaseModel, title: str) -> str:
    """YAML of params (JSON flow values: valid YAML, loaded back to the same tree), commented from the docstrings."""
    usage = "# Each key is documented in tasks/core/config/; override one with --set section.key=value."
    lines = [f"# {title}", usage, ""]
    for name, field in type(params).model_fields.items():
        section = getattr(params, name)
        lines.append(f"# {_first_sentence(field.description)}")
        lines.append(f"{name}:")
        assert isinstance(section, Section)
        for key, inner in type(section).model_fields.items():
            value = json.dumps(section.model_dump(mode="json")[key])
            lines.append(f"  {key}: {value}  # {_first_sentence(inner.description)}".rstrip(" #"))
        lines.append("")
    return "\n".join(lines)
