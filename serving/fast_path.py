"""The fast path: POST /v1/completions and /v1/feedback served straight from ASGI (``HotRoutes``), and the
body limit (``BodyLimit``) in front of everything else.

FastAPI's middleware, routing, dependency solving and response classes cost more CPU per request than the
gateway's own work (bench/RESULTS.md, "Gateway"); a hot route is a plain function of (headers, body) that
returns an ``Answer``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.errors import ANSWERED, ApiError, error_answer, error_body
from serving.logs import log_request
from serving.metrics import Metrics
from serving.protocol import SSE_DONE, Answer, encode_json, sse_chunk

CLIENT_GONE = 499  # the request log's status of a request whose client hung up before the answer (nginx's code)


class ClientGone(Exception):
    """The client disconnected before its answer was sent: there is no one to answer."""


class HangUp:
    """Whether the client of one request hung up once its body was read (an editor aborts a completion request
    when the user types on). A handler that cares calls ``watch()``; watching ends when the answer is sent.

    The ASGI server reports a closed connection as ``http.disconnect`` on the request's receive channel; a
    hang-up still in flight when the answer's first byte is handed to the server is not seen (the network's
    latency plus one turn of the event loop)."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self._receive = receive
        self._seen = asyncio.Event()
        self._task: asyncio.Task | None = None

    def watch(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._seen.set()

    @property
    def gone(self) -> bool:
        return self._seen.is_set()

    async def wait(self) -> None:
        await self._seen.wait()

    def set(self) -> None:
        """The client is known to be gone another way (the server closed its stream)."""
        self._seen.set()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


Handler = Callable[[Mapping[str, str], bytes, HangUp], Awaitable[Answer]]


class BodyLimit:
    """ASGI middleware: refuse a request body over max_bytes with 413 before anything parses it.

    A declared Content-Length is checked up front; a chunked body is counted as it arrives."""

    def __init__(self, app, max_bytes: int, metrics: Metrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            check_declared_size(declared.decode("latin-1") if declared is not None else None, self.max_bytes)
        except ApiError as err:
            self.metrics.requests.labels(scope["path"], "413").inc()
            return await JSONResponse(error_body(413, err.message), status_code=413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, body_too_large(self.max_bytes))
            return message

        return await self.app(scope, counted, send)


def check_declared_size(content_length: str | None, max_bytes: int) -> None:
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise ApiError(
            413, f"request body is {int(content_length)} bytes; the limit is {max_bytes} (serving.max_body_bytes)"
        )


def body_too_large(max_bytes: int) -> str:
    return f"request body exceeds the limit of {max_bytes} bytes (serving.max_body_bytes)"


class HotRoutes:
    """ASGI in front of the FastAPI app: POST /v1/completions and /v1/feedback, the two routes every suggestion
    takes, go straight to their handlers; everything else goes to FastAPI (which also documents these two).

    FastAPI's middleware, routing, dependency solving and response classes cost more CPU per request than the
    gateway's own work (bench/RESULTS.md, "Gateway"). Here a request costs its headers made a dict, its body
    read against serving.max_body_bytes, one handler call and two sends; the answers, errors and metrics are
    the same as FastAPI's."""

    def __init__(self, app: Any, routes: dict[str, Handler], max_body_bytes: int, metrics: Metrics):
        self.app, self.routes, self.max_body_bytes, self.metrics = app, routes, max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))  # the first of repeated headers
        hang_up = HangUp(receive)
        started = time.perf_counter()
        try:
            body = await self._body(receive, headers.get("content-length"))
            answer = await handler(headers, body, hang_up)
            if answer.stream is not None:  # a streamed completion: its events come while it is generated
                await self._stream(scope, send, answer, started)
                return
        except ClientGone:
            log_request(scope["path"], CLIENT_GONE, time.perf_counter() - started, {})
            return
        except ANSWERED as err:
            answer = error_answer(err, f"POST {scope['path']}")
        finally:
            hang_up.close()
        self.metrics.requests.labels(scope["path"], str(answer.status)).inc()
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()]
        content = encode_json(answer.body)
        start = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()), *extra]
        await send({"type": "http.response.start", "status": answer.status, "headers": start})
        await send({"type": "http.response.body", "body": content})
        log_request(scope["path"], answer.status, time.perf_counter() - started, answer.record)  # once it is sent

    async def _stream(self, scope, send, answer: Answer, started: float) -> None:
        """SSE events as the stream yields them: the response starts with its first event (an error before it is
        answered as any error is, ClientGone raised through), then [DONE]."""
        assert answer.stream is not None
        events = aiter(answer.stream)
        first = await anext(events)
        self.metrics.requests.labels(scope["path"], str(answer.status)).inc()
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()]
        start = [(b"content-type", b"text/event-stream; charset=utf-8"), *extra]
        await send({"type": "http.response.start", "status": answer.status, "headers": start})
        await send({"type": "http.response.body", "body": sse_chunk(first), "more_body": True})
        async for event in events:
            await send({"type": "http.response.body", "body": sse_chunk(event), "more_body": True})
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        log_request(scope["path"], answer.status, time.perf_counter() - started, answer.record)

    async def _body(self, receive, content_length: str | None) -> bytes:
        check_declared_size(content_length, self.max_body_bytes)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, body_too_large(self.max_body_bytes))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def as_response(answer: Answer) -> Response:
    """An Answer as a Starlette response: the same hot routes when FastAPI serves them (without HotRoutes). A stream
    starts once its first event came, as HotRoutes starts it (its headers are set by then)."""
    if answer.stream is not None:
        events = aiter(answer.stream)
        first = await anext(events)

        async def chunks():
            yield sse_chunk(first)
            async for event in events:
                yield sse_chunk(event)
            yield SSE_DONE

        return StreamingResponse(chunks(), answer.status, answer.headers, media_type="text/event-stream")
    return Response(encode_json(answer.body), answer.status, answer.headers, media_type="application/json")


def fastapi_route(handler: Handler, metrics: Metrics) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:  # errors go to the app's handlers, which count them
        hang_up = HangUp(request.receive)
        try:
            answer = await handler(request.headers, await request.body(), hang_up)
            response = await as_response(answer)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        finally:
            hang_up.close()
        metrics.requests.labels(request.url.path, str(answer.status)).inc()
        return response

    return route
