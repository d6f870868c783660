"""``/metrics`` of every service: the default registry (process, vLLM's families, http_*) plus
:data:`~libs.common.metrics_catalog.OMNI_REGISTRY` (ours), in the format the scraper asks for.

OpenMetrics is always encoded without escaping: prometheus_client would otherwise turn the ``:``
of every ``vllm:*`` sample name into ``_`` for Prometheus 2.x scrapers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics
from prometheus_client import exposition as text_format
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from libs.common.metrics_catalog import OMNI_REGISTRY

disable_created_metrics()  # no *_created series: they double /metrics and no dashboard uses them

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class _Both(Collector):
    def collect(self) -> Iterable:
        yield from REGISTRY.collect()
        yield from OMNI_REGISTRY.collect()


def exposition_registry() -> CollectorRegistry:
    """What a service's ``/metrics`` serves: the default registry plus :data:`OMNI_REGISTRY`."""
    both = CollectorRegistry(auto_describe=False)
    both.register(_Both())
    return both


EXPOSITION = exposition_registry()


def render(accept: str) -> tuple[bytes, str]:
    """(body, content type) of :data:`EXPOSITION` for a scraper's ``Accept`` header."""
    if "application/openmetrics-text" in (accept or ""):
        return openmetrics.generate_latest(
            EXPOSITION, escaping=openmetrics.ALLOWUTF8
        ), OPENMETRICS_CONTENT_TYPE
    return text_format.generate_latest(EXPOSITION), text_format.CONTENT_TYPE_PLAIN_0_0_4


Route = Callable[[], tuple[int, bytes, str]]
"""An extra ``GET`` path of a metrics server: returns (HTTP status, body, content type)."""


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/metrics", "/"):
            status, (body, content_type) = 200, render(self.headers.get("Accept", ""))
        elif (route := self.server.routes.get(path)) is not None:
            status, body, content_type = route()
        else:
            self.send_error(404)
            return
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


METRICS_HOST = "127.0.0.1"
"""Default bind address of every service's ``/metrics``."""


class MetricsServer(ThreadingHTTPServer):
    """``/metrics`` (and ``routes``) on ``host:port``, listening once constructed."""

    daemon_threads = True

    def __init__(self, host: str, port: int, routes: Mapping[str, Route] | None = None) -> None:
        super().__init__((host, port), _Handler)
        self.routes: dict[str, Route] = dict(routes or {})

    @property
    def port(self) -> int:
        return self.server_address[1]

    def close(self) -> None:
        """Stop serving (within the 0.5 s poll interval) and close the listening socket."""
        self.shutdown()
        self.server_close()


def serve_metrics(
    port: int, host: str = METRICS_HOST, routes: Mapping[str, Route] | None = None
) -> MetricsServer:
    """Serve ``/metrics`` (and ``routes``) on ``host:port`` in a background thread."""
    server = MetricsServer(host, port, routes)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def start_metrics_server(port: int, host: str = METRICS_HOST) -> int:
    """Serve ``/metrics`` on ``host:port`` for the process's life; returns the bound port."""
    return serve_metrics(port, host).port
