"""OpenTelemetry set-up and W3C context propagation through NATS headers.

Tracing is on when the standard ``OTEL_*`` variables set an OTLP endpoint or name an ``otlp`` or
``console`` trace exporter, and ``OTEL_SDK_DISABLED`` is not true. Off, every helper here returns
after one flag check. Failures of tracing never fail a request.
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


def _exporters(env: Mapping[str, str], default: str) -> set[str]:
    return {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", default).split(",") if e.strip()}


def tracing_configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for trace export."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = _exporters(env, "")
    if "none" in exporters:
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) or bool(exporters & {"otlp", "console"})


def _protocol(env: Mapping[str, str]) -> str:
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    return "http/protobuf" if raw.strip().startswith("http") else "grpc"


def otlp_traces_endpoint(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(traces endpoint, protocol) of the configured OTLP trace export, as the SDK resolves it."""
    if not tracing_configured(env) or "otlp" not in _exporters(env, "otlp"):
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
    """Install a tracer provider for ``omnirelay-<service>`` if asked; returns whether tracing is on."""
    global _enabled
    if not tracing_configured():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs: dict[str, str | int] = {"service.name": f"omnirelay-{service}", "omnirelay.pipeline": pipeline}
    attrs |= {k: v for k, v in (("omnirelay.stage", stage), ("omnirelay.replica", replica)) if v is not None}
    provider = TracerProvider(resource=Resource.create(attrs))
    exporters = _exporters(os.environ, "otlp")
    if "console" in exporters:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if "otlp" in exporters:
        if _protocol(os.environ) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on: service omnirelay-%s", service)
    return True


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
    """A started span (non-recording when tracing is off); ``start_time``: wall clock ns."""
    if not _enabled:
        return trace.INVALID_SPAN
    return trace.get_tracer("omnirelay").start_span(
        name, context=parent, kind=kind, attributes=attributes, links=links, start_time=start_time
    )


def trace_id_hex(span: Span) -> str | None:
    """The 32-hex-digit trace id of a recording span, else None."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
