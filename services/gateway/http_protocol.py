"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol (as vLLM's server runs) with
two bounds on a request's head, which uvicorn keeps only on h11 (the size) or not at all (the
time).

- **Size**: a head still arriving past ``max_head_bytes`` is answered with a 400 and the
  connection closed (what h11's ``max_incomplete_event_size`` does; llhttp has no such bound and
  would buffer the head without end). The bytes are counted per read while a head is incomplete;
  a head that completes within a read is let through and its size judged by
  :class:`services.gateway.request_size.RequestSizeLimit` (431). A read that also carries the end of
  the previous request (a pipelining client) counts whole, so such a client's next head may be
  refused a little early; no head is let past the bound.
- **Time**: a connection that has not sent a whole request head within ``head_timeout_s`` of its
  start, or of its previous response's end, is closed: a client that opens connections and sends
  their heads a byte at a time (slowloris) cannot hold them. A connection upgraded to a WebSocket
  (``/v1/realtime``) is the WebSocket protocol's from then on: it lives as long as its session.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_TOO_LARGE = "Request head too large."
"""The 400's body for a head past ``max_head_bytes``."""


class BoundedHeadHttpTools(HttpToolsProtocol):
    """httptools with :attr:`head_timeout_s` and :attr:`max_head_bytes` (set by
    :func:`bounded_http`)."""

    head_timeout_s: float = 10.0
    """Seconds a request's head may take to arrive."""
    max_head_bytes: int = 16 << 10
    """Bytes a request's head may have while it is still arriving."""
    _head_pending = False
    """A request's head has begun and is not complete."""
    _head_bytes = 0
    """Bytes read while the pending head arrived (whole reads)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._head_pending or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self.logger.warning("refusing a request head still arriving past %d bytes", self.max_head_bytes)
            self.send_400_response(HEAD_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_pending, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._head_pending = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        """Close the connection unless a new request's head has arrived by the deadline (uvicorn
        starts a new request cycle for each head)."""
        self.loop.call_later(self.head_timeout_s, self._expire, self.cycle)

    def _expire(self, cycle_then: object) -> None:
        if self.transport.get_protocol() is not self:  # upgraded: a WebSocket's now, not bounded here
            return
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %.0f s", self.head_timeout_s)
            self.transport.close()


def bounded_http(head_timeout_s: float, max_head_bytes: int) -> type[BoundedHeadHttpTools]:
    """The protocol class for uvicorn's ``http`` option: a head must arrive within
    ``head_timeout_s`` seconds and may have at most ``max_head_bytes`` bytes while it arrives."""
    bounds = {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes}
    return type("GatewayHttpTools", (BoundedHeadHttpTools,), bounds)
