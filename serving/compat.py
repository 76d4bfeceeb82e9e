"""Outcome formats other clients already send, mapped onto one ``Outcome``.

* RLinf's Continue fork posts to ``/api/training/submit``:
  ``{completionId, prefix, suffix, prompt, completion, accepted, time, modelName, ...}``.
* Upstream Continue logs autocomplete events to ``~/.continue/dev_data/0.2.0/autocomplete.jsonl``
  and posts them to HTTP ``data`` destinations as ``{name, data, schema, level, profileId}``.
  ``time`` is the latency in ms (not a timestamp). With ``level: noCode`` the texts are absent:
  the outcome is stored but marked untrainable.

Continue's ``completionId`` is its own uuid, not our response id, so these outcomes are matched to
our log by sha256(prompt + "\\0" + completion) (see ``serving.log.record_outcome``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from serving.log import Outcome, suffix_form_prompt

CONTINUE_SCHEMA = "0.2.0"
_TEXTS = ("prefix", "suffix", "prompt", "completion")


class CompatError(ValueError):
    """An outcome body that cannot be used; the message names the field."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # editors add fields over time; unknown ones are kept in the payload


class RlinfSubmit(_Lenient):
    accepted: StrictBool
    completionId: str | None = Field(None, max_length=128)
    prefix: str | None = None
    suffix: str | None = None
    prompt: str | None = None
    completion: str | None = None
    time: float | None = None
    modelName: str | None = None


class ContinueEvent(_Lenient):
    # Continue writes `accepted` when the outcome resolves (true on Tab, false after its timeout).
    accepted: StrictBool = False
    completionId: str | None = Field(None, max_length=128)
    prefix: str | None = None
    suffix: str | None = None
    prompt: str | None = None
    completion: str | None = None
    time: float | None = None  # latency in ms
    modelName: str | None = None


def _problem(err: ValidationError, where: str) -> CompatError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "body"
    return CompatError(f"{where}{loc}: {first['msg']}")


def _outcome(event: RlinfSubmit | ContinueEvent, source: str, trainable: bool) -> Outcome:
    prompt = event.prompt
    if prompt is None and event.prefix is not None and event.suffix is not None:
        prompt = suffix_form_prompt(event.prefix, event.suffix)
    payload = event.model_dump(mode="json")
    if not trainable:
        for name in _TEXTS:
            payload.pop(name, None)
    return Outcome(
        accepted=event.accepted,
        source=source,
        completion_id=event.completionId,
        prompt=prompt if trainable else None,
        completion=event.completion if trainable else None,
        accepted_chars=len(event.completion) if event.accepted and event.completion is not None else None,
        trainable=trainable,
        payload=payload,
    )


def outcome_from_rlinf(body: dict[str, Any]) -> Outcome:
    try:
        event = RlinfSubmit.model_validate(body)
    except ValidationError as err:
        raise _problem(err, "") from None
    return _outcome(event, "rlinf", trainable=event.completion is not None)


def outcome_from_continue(event: dict[str, Any], level: str, source: str) -> Outcome:
    """One Continue autocomplete event (the `data` of a destination POST, or a line of the jsonl)."""
    if level not in ("all", "noCode"):
        raise CompatError(f"level {level!r} must be 'all' or 'noCode'")
    try:
        parsed = ContinueEvent.model_validate(event)
    except ValidationError as err:
        raise _problem(err, "data.") from None
    trainable = level == "all" and parsed.prompt is not None and parsed.completion is not None
    return _outcome(parsed, source, trainable)


def texts_of(body: dict[str, Any]) -> dict[str, str]:
    """The text fields present in a body, for size checks."""
    return {name: body[name] for name in _TEXTS if isinstance(body.get(name), str)}
