"""The gateway's FastAPI application: OpenAI-compatible API in front of the pipeline's bus."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from libs.common.pipeline import PipelineConfig
from libs.common.settings import GatewaySettings
from libs.models.tiny import resolve_model
from services.gateway.errors import install_error_handlers
from services.gateway.pipeline_client import PipelineClient
from services.gateway.prompting import Tokenizer
from services.gateway.routes import router
from services.gateway.submission import Submitter


class ArrivalStamp:
    """ASGI middleware: records the wall clock (ns) at which each request arrived, before any
    other work, as ``scope["state"]["arrival_ns"]`` — the anchor of every request latency."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_ns"] = time.time_ns()
        await self.app(scope, receive, send)


def create_app(settings: GatewaySettings, pipeline: PipelineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = await asyncio.to_thread(Tokenizer, resolve_model(pipeline.stages[0].model))
        client = PipelineClient(settings, pipeline)
        await client.start()
        app.state.client = client
        app.state.submitter = Submitter(pipeline, client, tokenizer)
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(title="omnirelay gateway", lifespan=lifespan)
    app.state.pipeline = pipeline
    app.state.started = int(time.time())
    app.include_router(router)
    install_error_handlers(app)
    Instrumentator().instrument(app).expose(app, endpoint="/metrics", include_in_schema=False)
    app.add_middleware(ArrivalStamp)
    return app


def run_gateway(settings: GatewaySettings, pipeline: PipelineConfig) -> None:
    import uvicorn

    app = create_app(settings, pipeline)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(), access_log=False
    )
