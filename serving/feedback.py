"""The outcome routes: POST /v1/feedback (by our completion id), RLinf's /api/training/submit and Continue's
/api/continue/events (matched by id, then by prompt hash). Each records one outcome in the log."""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi import Request

from serving.auth import Caller
from serving.compat import CONTINUE_SCHEMA, CompatError, outcome_from_continue, outcome_from_rlinf, texts_of
from serving.errors import ApiError
from serving.fast_path import HangUp
from serving.log import Outcome, RecordFeedback, record_outcome
from serving.normalise import check_size
from serving.protocol import Answer, ContinueData, FeedbackRequest
from serving.state import Gateway


async def record(gw: Gateway, caller: Caller, outcome: Outcome, require_ours: bool) -> dict:
    """Store an outcome; the success body, or ApiError (404 unknown, 403 another user's, 409 a changed answer).
    require_ours: by our completion id only (/v1/feedback), recorded with the group commit's others at once."""
    if not caller.logged:
        return {"logged": False}
    owner = caller.user_id if caller.owner_checked else None
    op = RecordFeedback(outcome, owner) if require_ours else record_outcome(outcome, owner, require_ours=False)
    rec = await gw.writer.submit(op)
    gw.metrics.recorded(rec)
    if rec.status == "unknown":
        raise ApiError(
            404,
            f"unknown completion id {outcome.completion_id!r} (not served by this gateway, or opted out)",
            "completion_id",
        )
    if rec.status == "forbidden":
        raise ApiError(
            403,
            f"completion {rec.completion_id!r} belongs to another user; a key may only send feedback "
            "for its own completions",
            "completion_id",
        )
    if rec.status == "conflict":
        raise ApiError(
            409,
            f"feedback for {rec.completion_id!r} was already recorded as accepted={rec.accepted}, "
            f"shown={rec.shown}; the first answer wins",
            "accepted",
        )
    return {
        "completion_id": rec.completion_id,
        "matched": rec.matched,
        "accepted": rec.accepted,
        "shown": rec.shown,
        "duplicate": rec.status == "duplicate",
        "logged": True,
    }


async def feedback(gw: Gateway, headers: Mapping[str, str], body: bytes, _hang_up: HangUp) -> Answer:
    req = FeedbackRequest.model_validate_json(body)
    caller = await gw.caller_of(headers, None)
    outcome = Outcome(bool(req.accepted), "api", req.completion_id, accepted_chars=req.accepted_chars, shown=req.shown)
    answer = await record(gw, caller, outcome, require_ours=True)
    said = {"completion_id": req.completion_id, "user": caller.user_id, "team": caller.team}
    stored = "duplicate" if answer.get("duplicate") else "recorded" if answer["logged"] else "not logged"
    return Answer(200, answer, record=said | {"outcome": stored})


async def json_object(gw: Gateway, request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(422, f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise ApiError(422, f"body must be a JSON object, got {type(body).__name__}")
    return body


# These two routes parse their bodies by hand (lenient, size-checked first); the schemas are for the docs
# and the fuzzer.
async def rlinf_submit(gw: Gateway, request: Request):
    body = await json_object(gw, request)
    for name, text in texts_of(body).items():
        check_size(name, text, gw.s.max_text_chars if name != "prompt" else gw.s.max_prompt_chars)
    caller = await gw.caller_of(request.headers, None)
    try:
        outcome = outcome_from_rlinf(body)
    except CompatError as err:
        raise ApiError(422, str(err)) from None
    return gw.ok(request, await record(gw, caller, outcome, require_ours=False))


async def continue_events(gw: Gateway, request: Request):
    envelope = await json_object(gw, request)
    try:
        event = ContinueData.model_validate(envelope)
    except ValueError as err:
        raise ApiError(422, f"not a Continue data event ({{name, data, schema, level}}): {err}") from None
    if event.schema_ != CONTINUE_SCHEMA:
        raise ApiError(
            422,
            f"schema {event.schema_!r} is not supported; set `schema: {CONTINUE_SCHEMA}` on the data destination",
            "schema",
        )
    if event.name != "autocomplete":
        return gw.ok(request, {"ignored": True, "reason": f"event {event.name!r} is not used by tabrl"})
    for name, text in texts_of(event.data).items():
        check_size(f"data.{name}", text, gw.s.max_text_chars if name != "prompt" else gw.s.max_prompt_chars)
    caller = await gw.caller_of(request.headers, None)
    try:
        outcome = outcome_from_continue(event.data, event.level, "continue")
    except CompatError as err:
        raise ApiError(422, str(err)) from None
    return gw.ok(request, await record(gw, caller, outcome, require_ours=False))
