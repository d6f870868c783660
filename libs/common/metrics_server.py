"""Serving ``/metrics`` from services that have no HTTP server of their own (workers, orchestrator)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.registry import Collector

from libs.common.metrics_catalog import OMNI_REGISTRY

disable_created_metrics()  # no *_created series: they double /metrics and no dashboard uses them


class Registries(Collector):
    """Several registries exposed as one (the default one, with vLLM's families and the process
    collectors, and :data:`OMNI_REGISTRY` with ours)."""

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


def start_metrics_server(port: int) -> int:
    """Serve :data:`EXPOSITION` on ``0.0.0.0:port`` in a background thread; returns the
    bound port (``port=0`` picks a free one). OpenMetrics is served when the scraper asks for it."""
    server, _thread = start_http_server(port, addr="0.0.0.0", registry=EXPOSITION)
    return server.server_port
