"""``/metrics`` of every service: the default registry (process, vLLM's families, http_*) plus
:data:`~libs.common.metrics_catalog.OMNI_REGISTRY` (ours), in the format the scraper asks for.

OpenMetrics (with exemplars) when the ``Accept`` header allows it, else the Prometheus text format.
prometheus_client 0.26 escapes the ``:`` of sample names to ``_`` in OpenMetrics output unless the
scraper asked for ``escaping=allow-utf-8`` (while leaving ``# TYPE`` lines unescaped), which would
rename every ``vllm:*`` series for Prometheus 2.x scrapers. Our names are all valid classic names,
so we always encode without escaping: the output is plain OpenMetrics 1.0.0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics
from prometheus_client import exposition as text_format
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from libs.common.metrics_catalog import OMNI_REGISTRY

disable_created_metrics()  # no *_created series: they double /metrics and no dashboard uses them

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class Registries(Collector):
    """Several registries exposed as one."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self._registries = registries

    def collect(self) -> Iterable:
        for r in self._registries:
            yield from r.collect()


def exposition_registry() -> CollectorRegistry:
    """What a service's ``/metrics`` serves: the default registry plus :data:`OMNI_REGISTRY`."""
    both = CollectorRegistry(auto_describe=False)
    both.register(Registries(REGISTRY, OMNI_REGISTRY))
    return both


EXPOSITION = exposition_registry()
"""The process's ``/metrics`` content."""


def render(accept: str) -> tuple[bytes, str]:
    """(body, content type) of :data:`EXPOSITION` for a scraper's ``Accept`` header."""
    if "application/openmetrics-text" in (accept or ""):
        return openmetrics.generate_latest(
            EXPOSITION, escaping=openmetrics.ALLOWUTF8
        ), OPENMETRICS_CONTENT_TYPE
    return text_format.generate_latest(EXPOSITION), text_format.CONTENT_TYPE_PLAIN_0_0_4


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body, content_type = render(self.headers.get("Accept", ""))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


METRICS_HOST = "127.0.0.1"
"""Default bind address of the orchestrator's and workers' ``/metrics`` (``OMNIRELAY_METRICS_HOST``):
this machine only; compose binds ``0.0.0.0`` inside the container network for Prometheus."""


def start_metrics_server(port: int, host: str = METRICS_HOST) -> int:
    """Serve ``/metrics`` on ``host:port`` in a background thread; returns the bound port
    (``port=0`` picks a free one)."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_address[1]
