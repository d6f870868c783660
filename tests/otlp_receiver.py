"""A minimal OTLP/HTTP trace receiver for tests: collects the spans services export."""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry import trace as otel_trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.util._once import Once

from libs.common import tracing


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class SpanRecord:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, object]
    events: list[tuple[str, dict[str, object]]]
    links: list[tuple[str, str, dict[str, object]]]


@dataclass
class Receiver:
    spans: list[SpanRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    endpoint: str = ""

    def add(self, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    rec = SpanRecord(
                        service=str(attrs.get("service.name", "")),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        links=[
                            (
                                ln.trace_id.hex(),
                                ln.span_id.hex(),
                                {a.key: _value(a.value) for a in ln.attributes},
                            )
                            for ln in s.links
                        ],
                    )
                    with self.lock:
                        self.spans.append(rec)

    def trace(self, trace_id: str) -> list[SpanRecord]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def start_receiver() -> tuple[ThreadingHTTPServer, Receiver]:
    """Serve OTLP/HTTP ``POST /v1/traces`` on a free loopback port."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receiver.add(body)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, receiver


@contextlib.contextmanager
def tracing_in_this_process(
    service: str, pipeline: str, stage: int | None = None, replica: int | None = None
) -> Iterator[None]:
    """``setup_tracing`` for the test process (exporting where the environment says), undone on
    exit: the OTel API sets a process's tracer provider once, so this one is swapped in and the
    previous one and the ``tracing`` flag are put back — later tests run as if it never happened."""
    enabled_before = tracing._enabled
    provider_before = (otel_trace._TRACER_PROVIDER_SET_ONCE, otel_trace._TRACER_PROVIDER)
    otel_trace._TRACER_PROVIDER_SET_ONCE, otel_trace._TRACER_PROVIDER = Once(), None
    try:
        assert tracing.setup_tracing(service, pipeline, stage, replica)
        yield
    finally:
        tracing.shutdown_tracing()
        tracing._enabled = enabled_before
        otel_trace._TRACER_PROVIDER_SET_ONCE, otel_trace._TRACER_PROVIDER = provider_before
