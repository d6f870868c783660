"""The base of the ``llm`` stage handlers (thinker, talker): the stage's vLLM engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from libs.common import tracing
from libs.common.runtime import cancel_and_wait
from libs.models.tiny import resolve_model
from services.stage_worker.engine_priority import lowered_children
from services.stage_worker.engine_processes import export_engine_processes
from services.stage_worker.handlers.base import StageHandler
from services.stage_worker.llm_engine import (
    LLMEngineSpec,
    build_async_llm,
    engine_identity,
    engine_tracing_config,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams


class LLMHandler(StageHandler):
    """Base of the ``llm`` stage handlers: owns the engine's start and shutdown (and, with
    ``log_stats``, the periodic stats log line)."""

    def __init__(self, spec: LLMEngineSpec) -> None:
        super().__init__()
        self._spec = spec
        self._stage = spec.stage
        self.engine = None
        self._log_task: asyncio.Task[None] | None = None
        self._engine_traced = False

    def trace_headers(self, span: Span) -> dict[str, str] | None:
        """W3C headers carrying ``span`` into the engine (``generate(trace_headers=...)``), so the
        request's journey span joins its trace; None when the engine does not trace (one check)."""
        if not self._engine_traced:
            return None
        headers: dict[str, str] = {}
        tracing.inject_headers(headers, span)
        return headers or None

    async def generate(
        self, prompt: Any, params: SamplingParams, engine_id: str, span: Span
    ) -> AsyncGenerator[RequestOutput, None]:
        """``AsyncLLM.generate`` of one engine request, traced under ``span``, counted in
        ``progress``: busy while waiting for the engine's next output (not while the caller works
        on the last one), one step per output."""
        outputs = self.engine.generate(prompt, params, engine_id, trace_headers=self.trace_headers(span))
        async with contextlib.aclosing(outputs):
            while True:
                with self.progress.working():
                    try:
                        out = await anext(outputs)
                    except StopAsyncIteration:
                        return
                self.progress.advanced()
                yield out

    @property
    def model_path(self) -> str:
        return resolve_model(self._stage.model)

    async def start(self) -> None:
        self._engine_traced = engine_tracing_config(self._spec) is not None
        with lowered_children(self._spec.nice):
            self.engine = build_async_llm(self._spec, self.model_path)
        if self._spec.log_stats:
            export_engine_processes()
            from services.stage_worker.engine_metrics import log_stats_periodically

            self._log_task = asyncio.create_task(
                log_stats_periodically(
                    self.engine, self._spec.log_stats_interval_s, engine_identity(self._spec).label
                ),
                name="vllm-log-stats",
            )

    def engine_dead(self) -> bool:
        """vLLM's engine processes are gone (``AsyncLLM.errored``: its EngineCore died)."""
        return self.engine is not None and self.engine.errored

    async def stop(self) -> None:
        await cancel_and_wait(self._log_task)
        self._log_task = None
        if self.engine is not None:
            self.engine.shutdown()
