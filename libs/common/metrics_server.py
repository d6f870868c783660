"""Serving ``/metrics`` from services that have no HTTP server of their own (workers, orchestrator)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server


def start_metrics_server(port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Serve ``registry`` on ``0.0.0.0:port`` in a background thread; returns the bound port
    (``port=0`` picks a free one)."""
    server, _thread = start_http_server(port, addr="0.0.0.0", registry=registry)
    return server.server_port
