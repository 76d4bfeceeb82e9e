"""The base of every params section, and the error every bad params value raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ParamsError(ValueError):
    """A params file, override or value that cannot be used; the message says which and why."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
