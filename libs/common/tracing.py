"""OpenTelemetry set-up and W3C context propagation through NATS headers.

Tracing is configured by the standard ``OTEL_*`` environment variables. It is on when an OTLP
endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or
``OTEL_TRACES_EXPORTER`` names ``otlp``/``console``, and ``OTEL_SDK_DISABLED`` is not true. Off, no
tracer provider is installed: every helper here returns after one flag check, and the OpenTelemetry
API hands out non-recording spans.

Failures of tracing never fail a request: exporting runs in the SDK's batch processor thread, and
injection/extraction errors are swallowed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import context, trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import Link, Span, SpanKind

log = logging.getLogger(__name__)

_enabled = False


def tracing_configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for trace export."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) or bool(exporters & {"otlp", "console"})


def _protocol(env: Mapping[str, str]) -> str:
    raw = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    # _otlp_exporter exports every http* protocol as http/protobuf; do the same.
    return "http/protobuf" if raw.startswith("http") else "grpc"


def otlp_traces_endpoint(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(traces endpoint, protocol) the worker's OTLP exporter uses, or None when the environment
    configures no OTLP trace export (tracing off, or a console-only exporter).

    Resolved as the OpenTelemetry SDK does: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as is, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (with ``/v1/traces`` appended for HTTP), else the SDK
    default for the protocol.
    """
    if not tracing_configured(env):
        return None
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()}
    if "otlp" not in exporters:
        return None
    protocol = _protocol(env)
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not endpoint:
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if protocol == "grpc":
            endpoint = base or "http://localhost:4317"
        else:
            endpoint = f"{base.rstrip('/')}/v1/traces" if base else "http://localhost:4318/v1/traces"
    return endpoint, protocol


def setup_tracing(service: str, pipeline: str, stage: int | None = None, replica: int | None = None) -> bool:
    """Install a tracer provider for ``omnirelay-<service>`` if the environment asks for one.

    Resource attributes: ``service.name``, ``service.instance.id`` (from ``OTEL_RESOURCE_ATTRIBUTES``
    if given), ``omnirelay.pipeline``, ``omnirelay.stage``, ``omnirelay.replica``. Returns whether
    tracing is on.
    """
    global _enabled
    if not tracing_configured():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs: dict[str, str | int] = {"service.name": f"omnirelay-{service}", "omnirelay.pipeline": pipeline}
    if stage is not None:
        attrs["omnirelay.stage"] = stage
    if replica is not None:
        attrs["omnirelay.replica"] = replica
    provider = TracerProvider(resource=Resource.create(attrs))
    exporters = {e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()}
    if "console" in exporters:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if "otlp" in exporters:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on: service omnirelay-%s", service)
    return True


def _otlp_exporter():
    """OTLP over gRPC or HTTP/protobuf, as ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` says (gRPC default)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def enabled() -> bool:
    return _enabled


def shutdown_tracing() -> None:
    """Flush and stop the exporter (on service shutdown)."""
    if _enabled:
        provider = trace.get_tracer_provider()
        try:
            provider.shutdown()  # type: ignore[attr-defined]
        except Exception as e:
            log.warning("tracing shutdown failed: %s", e)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str], span: Span | None = None) -> None:
    """Add ``traceparent``/``tracestate`` for ``span`` (or the current context) to NATS headers."""
    if not _enabled:
        return
    try:
        ctx = trace.set_span_in_context(span) if span is not None else None
        inject(headers, context=ctx)
    except Exception as e:
        log.debug("trace context not injected: %s", e)


def context_from_headers(headers: Mapping[str, str] | None) -> context.Context | None:
    """The remote context carried by NATS headers, or None (tracing off or no context)."""
    if not _enabled or not headers:
        return None
    try:
        return extract(dict(headers))
    except Exception as e:
        log.debug("trace context not extracted: %s", e)
        return None


def start_span(
    name: str,
    parent: context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, object] | None = None,
    links: list[Link] | None = None,
    start_time: int | None = None,
) -> Span:
    """A started span (non-recording when tracing is off); the caller ends it. ``start_time``:
    wall clock ns (default now)."""
    if not _enabled:
        return trace.INVALID_SPAN
    return tracer("omnirelay").start_span(
        name, context=parent, kind=kind, attributes=attributes, links=links, start_time=start_time
    )


def trace_id_hex(span: Span) -> str | None:
    """The 32-hex-digit trace id of a recording span, else None."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
