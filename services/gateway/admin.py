"""The gateway's admin listener: ``/metrics`` and ``/prometheus/targets``, off the public port.

Clients reach the public port (the OpenAI API); Prometheus reaches this one. It listens on
``OMNIRELAY_METRICS_HOST:OMNIRELAY_ADMIN_PORT`` (``127.0.0.1:8001`` by default; compose binds the
container network and publishes no host port), asks for no API key, and serves:

- ``/metrics``: the process's exposition (:mod:`libs.common.metrics_server`: the http_* families of
  the public app's Instrumentator, process_*, the gateway's vllm:omni_* families);
- ``/prometheus/targets``: Prometheus HTTP service discovery (:mod:`services.gateway.discovery`),
  which names internal hosts, ports and instance ids, hence not on the public port.

It is the thread-served metrics server every other service uses, with the targets route added. The
registry view it reads belongs to the gateway's event loop, so a targets request takes its snapshot
there (:func:`on_loop`) rather than iterating it from the server's thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TypeVar

from libs.common.metrics_server import MetricsServer, serve_metrics

log = logging.getLogger(__name__)

T = TypeVar("T")

TARGETS_PATH = "/prometheus/targets"
JSON = "application/json"
SNAPSHOT_TIMEOUT_S = 5.0
"""How long a targets request waits for the event loop to take the registry snapshot, seconds
(Prometheus's SD request times out after its refresh interval)."""


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` run on ``loop`` (from another thread), its result within ``timeout_s`` seconds;
    raises :class:`TimeoutError`, or :class:`RuntimeError` when the loop is closed."""

    async def call() -> T:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout_s)


def _unavailable(message: str) -> tuple[int, bytes, str]:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}
    return 503, json.dumps(body).encode(), JSON


class AdminListener:
    """The admin listener of one gateway process, started on the running event loop; bound and
    serving once constructed (``port=0``: any free port, :attr:`port` says which)."""

    def __init__(self, host: str, port: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._targets: Callable[[], list[dict[str, object]]] | None = None
        self.server: MetricsServer = serve_metrics(port, host, {TARGETS_PATH: self._serve_targets})
        self.host = host
        log.info("admin listener (/metrics, %s, no API key) on http://%s:%d", TARGETS_PATH, host, self.port)

    @property
    def port(self) -> int:
        """The bound port."""
        return self.server.port

    def discover(self, targets: Callable[[], list[dict[str, object]]]) -> None:
        """Serve ``targets()`` (called on the event loop) at ``/prometheus/targets``; until then
        that path answers 503 (the gateway's registry view is not started)."""
        self._targets = targets

    def _serve_targets(self) -> tuple[int, bytes, str]:
        targets = self._targets
        if targets is None:
            return _unavailable("the gateway is starting: no registry view yet")
        try:
            groups = on_loop(self._loop, targets, SNAPSHOT_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as e:
            return _unavailable(f"no registry snapshot: {type(e).__name__}")
        return 200, json.dumps(groups).encode(), JSON

    async def close(self) -> None:
        """Stop serving and close the socket (off the event loop: the server's stop waits up to
        its 0.5 s poll interval)."""
        await asyncio.to_thread(self.server.close)
