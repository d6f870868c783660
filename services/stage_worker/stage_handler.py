"""The interface between the worker's bus plumbing and what a stage computes."""

from __future__ import annotations

from typing import Protocol

from libs.common.pipeline import Payload, PipelineConfig, StageType
from services.stage_worker.llm_engine import LLMEngineSpec, cpu_core_for
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


def make_handler(pipeline: PipelineConfig, stage_id: int, replica: int, log_stats: bool) -> StageHandler:
    """The handler for ``pipeline.stages[stage_id]`` (chosen by type and payloads)."""
    stage = pipeline.stages[stage_id]
    if stage.type == StageType.CODEC:
        from services.stage_worker.code2wav import Code2WavHandler

        return Code2WavHandler(stage)
    engine = LLMEngineSpec(stage, log_stats, cpu_core_for(pipeline, stage_id, replica))
    if stage.emits == Payload.TEXT:
        from services.stage_worker.thinker import ThinkerHandler

        return ThinkerHandler(engine, has_next=stage_id + 1 < len(pipeline.stages))
    from services.stage_worker.talker import TalkerHandler

    return TalkerHandler(engine)
