"""Stand-ins for what stands behind the gateway's routes in the unit tests, and a real uvicorn
server for an application in a thread of the test's own."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from libs.common.envelopes import Admission, decode
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
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        yield server
    finally:
        server.should_exit = True
        thread.join(10)
