"""The gateway's HTTP protocol (:mod:`services.gateway.http_protocol`) on a real uvicorn server,
spoken to over raw sockets: httptools with the two bounds on a request head — a head still
arriving past the size bound is a 400, one that does not arrive in time loses its connection —
and neither bound touches what is not a pending head (bodies, later requests of a connection, a
connection upgraded to a WebSocket)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

from fastapi import FastAPI, Request, WebSocket
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from websockets.sync.client import connect as ws_connect

from libs.common.settings import GatewaySettings
from libs.stack.local_nats import free_port
from services.gateway.app import server_options
from services.gateway.http_protocol import HEAD_TOO_LARGE
from tests.gateway_stubs import served

BOUND = 16 << 10
"""The head size bound the server runs with, bytes."""
PIECE = 1 << 10
"""A head sent in pieces is sent this many bytes at a time."""


def app() -> FastAPI:
    api = FastAPI()
    api.get("/ok")(lambda: {"ok": True})

    @api.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @api.websocket("/ws")
    async def echo_ws(ws: WebSocket) -> None:
        await ws.accept()
        while True:
            await ws.send_text(await ws.receive_text())

    return api


@contextlib.contextmanager
def serving(head_timeout_s: float = 10.0) -> Iterator[int]:
    """The gateway's server options on a free port; yields the port."""
    settings = GatewaySettings(
        port=free_port(), max_header_bytes=BOUND, request_head_timeout_s=head_timeout_s
    )
    with served(app(), **server_options(settings)):
        yield settings.port


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def head(pad: int, method: str = "GET", path: str = "/ok", body: bytes = b"") -> bytes:
    """A request head with one ``pad``-byte header (and a ``Content-Length`` for ``body``)."""
    length = f"Content-Length: {len(body)}\r\n" if body else ""
    return f"{method} {path} HTTP/1.1\r\nHost: gw\r\n{length}X-Pad: {'a' * pad}\r\n".encode()


def send_in_pieces(s: socket.socket, data: bytes) -> None:
    """Send ``data`` a :data:`PIECE` at a time (stops when the server has closed)."""
    for at in range(0, len(data), PIECE):
        try:
            s.sendall(data[at : at + PIECE])
        except OSError:
            return


def response(s: socket.socket) -> tuple[str, bytes]:
    """The status line and body of the next response (``Content-Length`` framed)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        got = s.recv(65536)
        assert got, f"the connection closed after {raw!r}"
        raw += got
    top, _, body = raw.partition(b"\r\n\r\n")
    status, *fields = top.decode().split("\r\n")
    length = int(next(f.split(":", 1)[1] for f in fields if f.lower().startswith("content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return status, body


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed the connection: an orderly end of stream, or a reset (the
    server closed with bytes of ours still unread, which the kernel answers with RST)."""
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_the_gateway_serves_on_httptools() -> None:
    protocol = server_options(GatewaySettings())["http"]
    assert isinstance(protocol, type) and issubclass(protocol, HttpToolsProtocol)


def test_a_head_arriving_in_pieces_past_the_bound_is_refused() -> None:
    with serving() as port, connect(port) as s:
        send_in_pieces(s, head(BOUND + 4 * PIECE))  # never finished
        status, body = response(s)
        assert status.startswith("HTTP/1.1 400") and body == HEAD_TOO_LARGE.encode()
        assert closed_by_server(s), "the connection stayed open"


def test_a_head_under_the_bound_arriving_in_pieces_is_served() -> None:
    with serving() as port, connect(port) as s:
        send_in_pieces(s, head(BOUND - 2 * PIECE) + b"\r\n")
        assert response(s) == ("HTTP/1.1 200 OK", b'{"ok":true}')


def test_bodies_and_later_heads_of_a_connection_are_not_counted_as_a_head() -> None:
    body = b"x" * (4 * BOUND)
    with serving() as port, connect(port) as s:
        for _ in range(3):  # each request's head just under the bound, each body four times over it
            send_in_pieces(s, head(BOUND - 2 * PIECE, "POST", "/echo", body) + b"\r\n" + body)
            assert response(s) == ("HTTP/1.1 200 OK", f'{{"bytes":{len(body)}}}'.encode())


def test_a_head_that_does_not_arrive_in_time_after_a_response_loses_its_connection() -> None:
    with serving(head_timeout_s=1.0) as port, connect(port) as s:
        s.sendall(head(10) + b"\r\n")
        assert response(s)[0] == "HTTP/1.1 200 OK"
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: gw\r\n")  # and the rest never
        t0 = time.monotonic()
        assert s.recv(4096) == b"", "the server answered a head it has not had"
        waited = time.monotonic() - t0
    assert 0.5 < waited < 20, waited


def test_a_websocket_idle_past_the_head_timeout_is_not_cut() -> None:
    """An upgraded connection is the WebSocket protocol's (a realtime session): idle for longer
    than the head timeout, it still answers."""
    with serving(head_timeout_s=1.0) as port, ws_connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10) as ws:
        ws.send("before")
        assert ws.recv(timeout=10) == "before"
        time.sleep(2.0)  # the thing under test: twice the head timeout with nothing sent
        ws.send("after")
        assert ws.recv(timeout=10) == "after"
