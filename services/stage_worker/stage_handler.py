"""The interface between the worker's bus plumbing and what a stage computes."""

from __future__ import annotations

from typing import Protocol

from libs.common.pipeline import Payload, PipelineConfig, StageType
from libs.common.settings import WorkerSettings
from services.stage_worker.engine_tracing import EngineTracing
from services.stage_worker.llm_engine import LLMEngineSpec
from services.stage_worker.request_context import RequestContext


class StageError(Exception):
    """A failure a handler can name: the client gets ``status`` and ``code``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class StageHandler(Protocol):
    """Runs one stage's engine. ``run`` processes one request from its first to its final input."""

    async def start(self) -> None: ...

    async def run(self, req: RequestContext) -> None: ...

    async def stop(self) -> None: ...


def make_handler(pipeline: PipelineConfig, settings: WorkerSettings) -> StageHandler:
    """The handler for the worker's stage (chosen by type and payloads)."""
    stage_id, replica = settings.stage, settings.replica
    stage = pipeline.stages[stage_id]
    if stage.type == StageType.CODEC:
        from services.stage_worker.code2wav import Code2WavHandler

        return Code2WavHandler(stage)
    engine = LLMEngineSpec.for_replica(
        pipeline,
        stage_id,
        replica,
        log_stats=settings.log_stats,
        log_stats_interval_s=settings.log_stats_interval_s,
        tracing=EngineTracing(
            journey_sample_rate=settings.journey_tracing_sample_rate,
            step_enabled=settings.step_tracing_enabled,
            step_sample_rate=settings.step_tracing_sample_rate,
            rich_subsample_rate=settings.step_tracing_rich_subsample_rate,
        ),
    )
    if stage.emits == Payload.TEXT:
        from services.stage_worker.thinker import ThinkerHandler

        return ThinkerHandler(engine, has_next=stage_id + 1 < len(pipeline.stages))
    from services.stage_worker.talker import TalkerHandler

    return TalkerHandler(engine)
