"""The gateway's logs: one JSON object per line (python-json-logger), a request log among them.

Every gateway process logs to stderr through `configure(serving.log_format)`: `json` (the default; what log
shippers and `jq` read) or `text`. The logger `tabrl.requests` writes one object per request on the hot routes,
after its answer: the path, the status, the latency, and what the handler says of it (`Answer.record`: the
completion id, the user and team, the arm, its team and the model version, or the outcome's status). No prompt,
completion, key or body is ever logged (SECURITY.md).
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

REQUESTS = logging.getLogger("tabrl.requests")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(log_format: Literal["json", "text"]) -> None:
    """The root logger of this process writes `log_format` lines to stderr at INFO (replacing its handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields={"levelname": "level"})
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def log_request(path: str, status: int, seconds: float, record: dict) -> None:
    """One request on a hot route, as the request log's object (its fields, then the handler's record)."""
    REQUESTS.info("request", extra={"path": path, "status": status, "latency_ms": round(seconds * 1000, 2), **record})
