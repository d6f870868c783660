"""Stand-ins for what stands behind the gateway's routes in the unit tests, and a real uvicorn
server for an application in a thread of the test's own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from libs.common.envelopes import Admission, decode
from libs.stack.processes import wait_for
from services.gateway.errors import APIError
from services.gateway.schemas import Health

REFUSED = 503
"""The stand-in client's answer to every submission it records."""


class RecordingClient:
    """Records each admission it is handed (as the bus would carry it: encoded and decoded again),
    then refuses it, as a bus that is away would; answers ``/health`` as a healthy pipeline."""

    gateway_id = "gw-test"

    def __init__(self) -> None:
        self.published: list[Admission] = []

    async def submit(self, adm: Admission, trace_headers: dict[str, str]) -> None:
        self.published.append(decode(Admission, adm.encode()))
        raise APIError(REFUSED, "recorded by the test", "bus_unavailable")

    def health(self) -> Health:
        return Health(status="ok", bus=True, orchestrators=1, stages={})


@contextlib.contextmanager
def served(app: Any, start_timeout_s: float = 30.0, **options: Any) -> Iterator[uvicorn.Server]:
    """``app`` on a real uvicorn server (``options``: its ``Config``) in a thread of its own,
    once it accepts connections; stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:

        def started() -> bool:
            assert server.started or thread.is_alive(), "the server did not start (its thread ended)"
            return server.started

        wait_for(started, "the server started", start_timeout_s, every_s=0.02)
        yield server
    finally:
        server.should_exit = True
        thread.join(10)
