"""ASGI middleware bounding what one HTTP request may make the gateway hold: its headers
(count and bytes: 431) and its body (413), answered in OpenAI's error shape before any route runs.

The body is checked twice: against ``Content-Length`` before a byte of it is read, and while it
is read, for chunked bodies (which have no length) and for a length that lies. A head that is
still arriving is bounded by the gateway's HTTP protocol (:mod:`services.gateway.http_protocol`,
a 400), which lets a complete head that came in one read through: its bytes are checked here.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.gateway.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PAYLOAD_TOO_LARGE = 413
HEADERS_TOO_LARGE = 431


async def send_error(send: Send, error: APIError) -> None:
    """Answer ``error`` as a complete JSON response (the connection closes after it)."""
    body = json.dumps(error.body().model_dump()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def too_large(max_bytes: int) -> APIError:
    return APIError(
        PAYLOAD_TOO_LARGE,
        f"the request body is larger than this server takes ({max_bytes} bytes)",
        "request_too_large",
    )


class RequestSizeLimit:
    """At most ``max_headers`` headers of ``max_header_bytes`` together (names and values) and
    ``max_body_bytes`` of body per request.

    A body within the limit is read here whole and handed to the application as one message;
    later ``receive`` calls (the routes' disconnect checks) go to the server as before."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_headers: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > self.max_headers or size > self.max_header_bytes:
            message = (
                f"the request's headers ({len(headers)}, {size} bytes) are more than this server takes "
                f"({self.max_headers}, {self.max_header_bytes} bytes)"
            )
            await send_error(send, APIError(HEADERS_TOO_LARGE, message, "request_headers_too_large"))
            return
        length = dict(headers).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(send, too_large(self.max_body_bytes))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await send_error(send, too_large(self.max_body_bytes))
                return
            if not message.get("more_body", False):
                break
        first = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay([first], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that returns ``messages`` first, then whatever the server sends."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
