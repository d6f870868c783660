"""The gateway's HTTP/1.1 protocol: uvicorn's h11 protocol with a deadline for a request's head.

uvicorn bounds a head's size (``h11_max_incomplete_event_size``) but not how long it may take
to arrive: a client that opens connections and sends their heads a byte at a time (slowloris)
holds them open for as long as it likes. Here a connection that has not sent a whole request
head within ``head_timeout_s`` of its start, or of its previous response's end, is closed.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineH11(H11Protocol):
    """h11 with :attr:`head_timeout_s` (set by :func:`with_head_deadline`)."""

    head_timeout_s: float = 10.0
    """Seconds a request's head may take to arrive."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        """Close the connection unless a new request's head has arrived by the deadline (uvicorn
        starts a new request cycle for each head)."""
        self.loop.call_later(self.head_timeout_s, self._expire, self.cycle)

    def _expire(self, cycle_then: object) -> None:
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %.0f s", self.head_timeout_s)
            self.transport.close()


def with_head_deadline(head_timeout_s: float) -> type[HeadDeadlineH11]:
    """The protocol class for uvicorn's ``http`` option, with this deadline, seconds."""
    return type("GatewayH11", (HeadDeadlineH11,), {"head_timeout_s": head_timeout_s})
