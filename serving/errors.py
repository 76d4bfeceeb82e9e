"""The gateway's error answers: an exception that carries its HTTP status, and the OpenAI error shape.

A leaf of serving/: auth, the router and the gateway raise `ApiError`; the gateway's handlers turn
it into `error_body` JSON.
"""

from __future__ import annotations

RETRY_AFTER_S = 2  # Retry-After of a 503 while a store (the log, Redis) is unavailable


class ApiError(Exception):
    """An answer other than 200, with a message naming the problem (OpenAI error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else ("store_unavailable" if status == 503 else "backend_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
