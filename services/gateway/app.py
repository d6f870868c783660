"""The gateway's FastAPI application: OpenAI-compatible API in front of the pipeline's bus."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import PipelineConfig
from libs.common.runtime import freeze_startup_heap
from libs.common.settings import GatewaySettings
from libs.common.tracing import setup_tracing, shutdown_tracing
from libs.models.tiny import resolve_model
from services.gateway.admin import AdminListener
from services.gateway.auth import load_api_keys
from services.gateway.discovery import sd_targets
from services.gateway.errors import install_error_handlers
from services.gateway.http_protocol import bounded_http
from services.gateway.limits import ConcurrencyLimit, InputLimits, SlotRelease
from services.gateway.pipeline_client import PipelineClient
from services.gateway.prompting import Tokenizer
from services.gateway.realtime.protocol import MAX_EVENT_BYTES
from services.gateway.realtime.route import router as realtime_router
from services.gateway.realtime.route import secrets_api
from services.gateway.request_size import RequestSizeLimit
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.responses import SlowReader, abandon, body_started, finish
from services.gateway.routes import router
from services.gateway.speech_stream import router as speech_stream_router
from services.gateway.submission import Submitter

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
"""An admitted request's id (its key in ``omni_requests``) on each of its HTTP responses, errors
included (OpenAI's client reads it as ``request_id``); a request refused before its admission has
none, nor has the 500 of an unexpected exception (Starlette renders it outside every middleware)."""


class ResponseTimer:
    """ASGI middleware timing each HTTP request on the gateway's clocks.

    Stamps the arrival before any other work — wall clock ns (``Omni-Arrival-Ns``, the anchor
    carried to every service) and ``time.monotonic()`` (for intervals measured here) — and, for
    a request with a submitted job (``scope["state"]["job"]``), records when the response body's
    first and last bytes were handed to the HTTP server.

    Every response of a request with a job names it in :data:`REQUEST_ID_HEADER`, an error
    included.

    It also ends a response whose client reads too slowly (:class:`SlowReader`: too many events
    waiting, or a body write not taken within ``send_timeout_s``): the request is aborted in every
    stage, counted, and the connection closed.
    """

    def __init__(self, app, send_timeout_s: float) -> None:
        self.app = app
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["arrival_ns"], state["arrival_s"] = time.time_ns(), time.monotonic()
        first_body = True

        async def timed_send(message) -> None:
            nonlocal first_body
            job = state.get("job")
            if job is None or message["type"] != "http.response.body":
                if job is not None and message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER, job.id.encode())]
                await send(message)
                return
            # Stamped before the bytes are handed to the server: after ``send`` returns, this loop
            # may run other work first, and the client can have read the bytes long before.
            now = time.monotonic()
            if first_body:
                first_body = False
                body_started(job, now)
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise SlowReader(f"a write not taken within {self.send_timeout_s:.0f} s") from None
            if not message.get("more_body", False):
                finish(job, now)

        try:
            await self.app(scope, receive, timed_send)
        except SlowReader as e:
            job = state["job"]
            log.warning("request %s: the client reads too slowly (%s); aborted, connection closed", job.id, e)
            job.log.slow_reader()
            abandon(job)  # the server closes the connection: the response was not completed


def create_app(settings: GatewaySettings, pipeline: PipelineConfig) -> FastAPI:
    """The gateway's application; raises :class:`~services.gateway.auth.AuthConfigError` when
    its API-key set-up must not serve (:func:`~services.gateway.auth.load_api_keys`)."""
    api_keys = load_api_keys(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = await asyncio.to_thread(Tokenizer, resolve_model(pipeline.thinker.model))
        stat_log = GatewayStatLogger(
            MetricSet(Exporter.GATEWAY, settings.log_stats), pipeline.served_model_name
        )
        # The admin listener first: the registry record names its bound port (admin_port 0: any).
        admin = AdminListener(settings.metrics_host, settings.admin_port)
        bound = settings.model_copy(update={"admin_port": admin.port})
        try:
            client = PipelineClient(
                bound, pipeline, stat_log.stale_event, stat_log.event_gap, stat_log.bus_rejected
            )
            await client.start()
            admin.discover(lambda: sd_targets(client.all_services.live()))
            app.state.client = client
            app.state.submitter = Submitter(pipeline, client, tokenizer, stat_log, InputLimits.of(settings))
            freeze_startup_heap()
            try:
                yield
            finally:
                await client.stop()
                shutdown_tracing()
        finally:
            await admin.close()

    # /docs, /redoc and /openapi.json only when asked for; app.openapi() builds the schema anyway.
    docs = settings.gateway_docs
    app = FastAPI(
        title="omnirelay gateway",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.pipeline = pipeline
    app.state.api_keys = api_keys
    app.state.concurrency = concurrency = ConcurrencyLimit(settings.max_concurrent_per_key)
    app.state.started = int(time.time())
    app.state.realtime_sessions = ConcurrencyLimit(settings.max_realtime_sessions_per_key)
    for routes in (router, realtime_router, secrets_api, speech_stream_router):
        app.include_router(routes)
    install_error_handlers(app)
    # Middleware added first runs innermost: size limits inside the http_* metrics (a 413 counts).
    app.add_middleware(
        RequestSizeLimit,
        max_body_bytes=settings.max_body_bytes,
        max_headers=settings.max_headers,
        max_header_bytes=settings.max_header_bytes,
    )
    Instrumentator().instrument(app)  # http_* families, served on the admin port (services/gateway/admin.py)
    app.add_middleware(SlotRelease, limit=concurrency)
    app.add_middleware(ResponseTimer, send_timeout_s=settings.slow_reader_timeout_s)
    return app


def server_options(settings: GatewaySettings) -> dict[str, object]:
    """uvicorn's options for the gateway: httptools, as vLLM's server runs, with a bound on the
    size of a request head still arriving (a larger one is a 400) and a deadline for the head
    (:mod:`services.gateway.http_protocol`), and the keep-alive timeout."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "access_log": False,
        "http": bounded_http(settings.request_head_timeout_s, settings.max_header_bytes),
        "timeout_keep_alive": settings.keep_alive_s,
        "ws": "websockets",
        "ws_max_size": MAX_EVENT_BYTES,
    }


def run_gateway(settings: GatewaySettings, pipeline: PipelineConfig) -> None:
    import uvicorn

    setup_tracing("gateway", pipeline.name)
    app = create_app(settings, pipeline)
    uvicorn.run(app, **server_options(settings))
