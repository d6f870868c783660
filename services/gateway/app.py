"""The gateway's FastAPI application: OpenAI-compatible API in front of the pipeline's bus."""

from __future__ import annotations

import asyncio
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
from services.gateway.errors import install_error_handlers
from services.gateway.pipeline_client import PipelineClient
from services.gateway.prompting import Tokenizer
from services.gateway.request_stats import GatewayStatLogger
from services.gateway.responses import body_started, finish
from services.gateway.routes import router
from services.gateway.submission import Submitter


class ResponseTimer:
    """ASGI middleware timing each HTTP request on the gateway's clocks.

    Stamps the arrival before any other work — wall clock ns (``Omni-Arrival-Ns``, the anchor
    carried to every service) and ``time.monotonic()`` (for intervals measured here) — and, for
    a request with a submitted job (``scope["state"]["job"]``), records when the response body's
    first and last bytes were handed to the HTTP server.
    """

    def __init__(self, app) -> None:
        self.app = app

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
                await send(message)
                return
            # Stamped before the bytes are handed to the server: after ``send`` returns, this loop
            # may run other work first, and the client can have read the bytes long before.
            now = time.monotonic()
            if first_body:
                first_body = False
                body_started(job, now)
            await send(message)
            if not message.get("more_body", False):
                finish(job, now)

        await self.app(scope, receive, timed_send)


def create_app(settings: GatewaySettings, pipeline: PipelineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = await asyncio.to_thread(Tokenizer, resolve_model(pipeline.stages[0].model))
        stat_log = GatewayStatLogger(
            MetricSet(Exporter.GATEWAY, settings.log_stats), pipeline.served_model_name
        )
        client = PipelineClient(settings, pipeline, stat_log.stale_event, stat_log.event_gap)
        await client.start()
        app.state.client = client
        app.state.submitter = Submitter(pipeline, client, tokenizer, stat_log)
        freeze_startup_heap()
        try:
            yield
        finally:
            await client.stop()
            shutdown_tracing()

    app = FastAPI(title="omnirelay gateway", lifespan=lifespan)
    app.state.pipeline = pipeline
    app.state.started = int(time.time())
    app.include_router(router)
    install_error_handlers(app)
    Instrumentator(excluded_handlers=["/metrics"]).instrument(app)  # http_* families; served by /metrics
    app.add_middleware(ResponseTimer)
    return app


def run_gateway(settings: GatewaySettings, pipeline: PipelineConfig) -> None:
    import uvicorn

    setup_tracing("gateway", pipeline.name)
    app = create_app(settings, pipeline)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(), access_log=False
    )
