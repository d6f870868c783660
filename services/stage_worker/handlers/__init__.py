"""What each kind of stage computes, one :class:`~.base.StageHandler` per kind: ``thinker`` and
``talker`` (``llm`` stages on vLLM, :mod:`.llm`), ``code2wav`` (``codec``) and ``listener`` (``asr``).
:func:`make_handler` imports only the worker's: a code2wav or listener worker never loads vLLM."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from libs.common.pipeline import Payload, PipelineConfig, StageType
from libs.common.settings import WorkerSettings
from services.stage_worker.handlers.base import StageHandler

if TYPE_CHECKING:
    from services.stage_worker.handlers.listener import Listened


def make_handler(
    pipeline: PipelineConfig, settings: WorkerSettings, on_listened: Callable[[Listened], None]
) -> StageHandler:
    """The handler for the worker's stage (chosen by type and payloads); ``on_listened``: told of
    a listener's every transcription."""
    stage_id, replica = settings.stage, settings.replica
    stage = pipeline.stages[stage_id]
    if stage.type == StageType.CODEC:
        from services.stage_worker.handlers.code2wav import Code2WavHandler

        return Code2WavHandler(stage, settings.engine_nice)
    if stage.type == StageType.ASR:
        from services.stage_worker.handlers.listener import ListenerHandler

        return ListenerHandler(stage, on_listened, settings.engine_nice)
    from services.stage_worker.engine_core.tracing_config import EngineTracing
    from services.stage_worker.handlers.talker import TalkerHandler
    from services.stage_worker.handlers.thinker import ThinkerHandler
    from services.stage_worker.llm_engine import LLMEngineSpec

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
        nice=settings.engine_nice,
    )
    if stage.emits == Payload.TEXT:
        return ThinkerHandler(engine)
    return TalkerHandler(engine)
