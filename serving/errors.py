"""The gateway's error answers: an exception that carries its HTTP status, the OpenAI error shape, and the
handlers that give every error that shape (a hot route's answer, or FastAPI's exception handlers).

`ApiError` is raised by auth, the limits, the router and the handlers; nothing here imports them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from serving.log import STORE_UNAVAILABLE
from serving.protocol import Answer

if TYPE_CHECKING:
    from serving.metrics import Metrics

log = logging.getLogger("tabrl.gateway")

RETRY_AFTER_S = 2  # Retry-After of a 503 while a store (the log, Redis) is unavailable


class ApiError(Exception):
    """An answer other than 200, with a message naming the problem (OpenAI error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else ("store_unavailable" if status == 503 else "backend_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error the gateway answers, in the OpenAI error shape, counted by endpoint and status."""

    def error(
        request: Request, status: int, message: str, param: str | None = None, headers: dict | None = None
    ) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(status)).inc()
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return error(request, err.status, err.message, err.param, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        return error(request, err.status_code, str(err.detail), headers=err.headers)

    async def _store_unavailable(request: Request, err: Exception) -> JSONResponse:
        answer = store_unavailable(err, f"{request.method} {request.url.path}")
        return error(request, answer.status, answer.body["error"]["message"], headers=answer.headers)

    for kind in STORE_UNAVAILABLE:
        app.add_exception_handler(kind, _store_unavailable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return error(request, 422, validation_message(err.errors()))

    @app.exception_handler(ValidationError)  # a hot route's body, validated by the handler itself
    async def _invalid_body(request: Request, err: ValidationError) -> JSONResponse:
        return error(request, 422, validation_message(err.errors()))


def validation_message(errors: Any) -> str:
    """pydantic's errors as one line naming each field ("malformed JSON body: ..." when it is not JSON)."""
    problems = []
    for e in errors:
        if e["type"] == "json_invalid":
            problems.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e['msg'])}")
        else:
            loc = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
            problems.append(f"{loc}: {e['msg']}")
    return "; ".join(problems)


def store_unavailable(err: Exception, what: str) -> Answer:
    """503 + Retry-After: the log store could not take the write (locked, unreachable); nothing was recorded."""
    # Only the driver's own message: SQLAlchemy's str(err) carries the statement's parameters (prompts).
    driver = getattr(err, "orig", None)
    reason = f"{type(driver or err).__name__}: {str(driver or '').strip()[:200]}"
    log.warning("log store unavailable (%s): %s", what, reason)
    message = f"the log store is unavailable ({reason}); nothing was recorded, retry after {RETRY_AFTER_S} s"
    return Answer(503, error_body(503, message), {"Retry-After": str(RETRY_AFTER_S)})


def error_answer(err: Exception, what: str) -> Answer:
    """The OpenAI-shaped answer to an error a hot route expects (ANSWERED); what: "METHOD /path" for the log."""
    if isinstance(err, ApiError):
        return Answer(err.status, error_body(err.status, err.message, err.param), err.headers or {})
    if isinstance(err, ValidationError):
        return Answer(422, error_body(422, validation_message(err.errors())))
    return store_unavailable(err, what)


ANSWERED = (ApiError, ValidationError, *STORE_UNAVAILABLE)  # errors a hot route turns into a 4xx/5xx answer
