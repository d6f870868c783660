"""How tracing inside a vLLM engine (docs/engine-tracing.md) is configured, carried into the
EngineCore process, sampled, and exported.

The worker builds an :class:`EngineTracingConfig`; ``build_async_llm`` puts it, as a dict, in
``AsyncEngineArgs(additional_config={ADDITIONAL_CONFIG_KEY: ...})``, which vLLM hands to the
EngineCore, where ``OmniScheduler`` reads it back with :meth:`EngineTracingConfig.from_vllm_config`
(invalid values raise: the engine fails to start). No key: no tracing objects in the engine. The
engine exports through a tracer provider of its own (:func:`make_tracer_provider`).

Samplers are ``sampler(key, rate) -> bool``: :func:`random_sampler` in production,
:func:`make_deterministic_sampler` (stable across processes and runs) for tests. Rate 0 never
samples, rate 1 always does.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

ADDITIONAL_CONFIG_KEY = "omnirelay_engine_tracing"
"""Key of our settings in ``VllmConfig.additional_config``."""

ENGINE_SERVICE_NAME = "omnirelay-engine"
"""``service.name`` of the spans the EngineCore exports."""

INSTRUMENTATION_SCOPE = "omnirelay.engine"

PROTOCOLS = ("grpc", "http/protobuf")
"""OTLP protocols the engine exporter (and vLLM's own exporter) speak."""

SAMPLERS = ("random", "sha1")

Sampler = Callable[[object, float], bool]
"""``sampler(key, rate)``: whether ``key`` (a request id, trace id or step id) is sampled."""


def random_sampler(key: object, rate: float) -> bool:
    """Production sampler: independent coin flips (``random.random() < rate``)."""
    return random.random() < rate


def make_deterministic_sampler(seed: int | str = 0) -> Sampler:
    """A stable sampler: ``key`` is sampled iff the first 8 bytes of ``sha1(f"{seed}:{key}")``,
    read as a big-endian fraction of 2**64, are below ``rate`` (same answer in every process)."""

    def sampler(key: object, rate: float) -> bool:
        digest = hashlib.sha1(f"{seed}:{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < rate

    return sampler


def validate_rate(name: str, value: object) -> float:
    """``value`` as a float in [0, 1], or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and 0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return v


@dataclass(frozen=True)
class EngineTracing:
    """What the engine traces: journey events and scheduler steps; rates in [0, 1] (else
    ``ValueError``). ``sampler``: ``random`` or ``sha1`` (the journey, step and rich samplers
    seeded ``seed``, ``seed + 1``, ``seed + 2``, so they are independent)."""

    journey_sample_rate: float = 1.0
    step_enabled: bool = False
    step_sample_rate: float = 0.01
    rich_subsample_rate: float = 0.001
    sampler: str = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("journey_sample_rate", "step_sample_rate", "rich_subsample_rate"):
            object.__setattr__(self, name, validate_rate(name, getattr(self, name)))
        if not isinstance(self.step_enabled, bool):
            raise ValueError(f"step_enabled must be a bool, got {self.step_enabled!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def journey_enabled(self) -> bool:
        return self.journey_sample_rate > 0.0

    @property
    def active(self) -> bool:
        """Whether the engine has anything to trace."""
        return self.journey_enabled or self.step_enabled


@dataclass(frozen=True, kw_only=True)
class EngineTracingConfig(EngineTracing):
    """Everything the EngineCore needs to trace: the :class:`EngineTracing` knobs and where to
    export the spans."""

    endpoint: str
    protocol: str = "grpc"
    service_name: str = ENGINE_SERVICE_NAME
    resource: dict[str, str | int] = field(default_factory=dict)
    """Extra resource attributes (``omnirelay.pipeline``/``stage``/``replica``, ...)."""

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ValueError(f"endpoint must be a non-empty string, got {self.endpoint!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        super().__post_init__()
        if not isinstance(self.resource, dict):
            raise ValueError(f"resource must be a dict, got {self.resource!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> EngineTracingConfig | None:
        """Our settings as carried by ``vllm_config.additional_config``; None if absent.
        Invalid settings raise ``ValueError`` (the engine must not start with them)."""
        extra = getattr(vllm_config, "additional_config", None)
        if not isinstance(extra, Mapping) or ADDITIONAL_CONFIG_KEY not in extra:
            return None
        raw = extra[ADDITIONAL_CONFIG_KEY]
        try:
            if not isinstance(raw, Mapping):
                raise ValueError(f"{ADDITIONAL_CONFIG_KEY} must be a mapping, got {type(raw).__name__}")
            unknown = sorted(set(raw) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"{ADDITIONAL_CONFIG_KEY}: unknown keys {unknown}")
            return cls(**dict(raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid engine tracing settings ({ADDITIONAL_CONFIG_KEY}): {e}") from e

    def samplers(self) -> tuple[Sampler, Sampler, Sampler]:
        """(journey, step, rich) samplers."""
        if self.sampler == "sha1":
            return tuple(make_deterministic_sampler(self.seed + i) for i in range(3))  # type: ignore[return-value]
        return random_sampler, random_sampler, random_sampler


def make_tracer_provider(cfg: EngineTracingConfig):  # -> opentelemetry.sdk.trace.TracerProvider
    """A tracer provider (not installed globally) exporting to ``cfg.endpoint`` in batches; the
    SDK's own ``OTEL_*`` settings apply."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    attrs: dict[str, str | int] = {
        **cfg.resource,
        "service.name": cfg.service_name,
        "vllm.process_kind": "engine_core",
        "process.pid": os.getpid(),
    }
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.endpoint)))
    return provider
