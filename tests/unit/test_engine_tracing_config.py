"""Engine tracing's configuration (docs/contract.md, "Tracing"): the deterministic samplers against
their documented rule, the settings' validation, and how a worker's settings reach the engine.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


from libs.common.pipeline import load_pipeline
from libs.common.tracing import otlp_traces_endpoint
from services.stage_worker.engine_core.tracing_config import (
    ADDITIONAL_CONFIG_KEY,
    EngineTracing,
    EngineTracingConfig,
    make_deterministic_sampler,
)
from services.stage_worker.llm_engine import LLMEngineSpec, engine_tracing_config
from tests.scheduler_driver import add, documented_sample, make_scheduler, run_until_idle, tracing_settings

SAMPLER_KEYS: list[object] = [
    *range(1, 400),
    *(f"req-{i}" for i in range(200)),
    *(format(0x9E3779B97F4A7C15 * i, "032x")[-32:] for i in range(1, 200)),
]
"""Step ids (int), request ids and trace ids (32 hex digits): every kind of key the samplers get."""


@pytest.mark.parametrize("seed", [0, 1, 11])
@pytest.mark.parametrize("rate", [0.001, 0.25, 0.5, 0.9])
def test_deterministic_sampler_follows_the_documented_rule(seed: int, rate: float) -> None:
    sampler = make_deterministic_sampler(seed)
    got = [k for k in SAMPLER_KEYS if sampler(k, rate)]
    assert got == [k for k in SAMPLER_KEYS if documented_sample(seed, k, rate)]
    # and the rule is a sample at the rate (binomial: within 5 standard deviations)
    n = len(SAMPLER_KEYS)
    assert abs(len(got) - rate * n) <= 5 * math.sqrt(n * rate * (1 - rate)) + 1


def test_deterministic_sampler_edges_and_stability() -> None:
    s0 = make_deterministic_sampler(0)
    # rate 0 never, rate 1 always; stable across instances; seeds give different picks
    assert not any(s0(k, 0.0) for k in SAMPLER_KEYS) and all(s0(k, 1.0) for k in SAMPLER_KEYS)
    assert [s0(k, 0.3) for k in SAMPLER_KEYS] == [make_deterministic_sampler(0)(k, 0.3) for k in SAMPLER_KEYS]
    picks = [[k for k in SAMPLER_KEYS if make_deterministic_sampler(s)(k, 0.5)] for s in (0, 1)]
    assert picks[0] != picks[1]


def test_config_samplers_are_independent_per_stage() -> None:
    """Journey, step and rich samplers use seeds ``seed``, ``seed + 1``, ``seed + 2`` (the docs)."""
    journey, steps, rich = EngineTracingConfig(**tracing_settings(seed=5)).samplers()
    picks = [[k for k in range(200) if s(k, 0.5)] for s in (journey, steps, rich)]
    assert picks[0] != picks[1] != picks[2]
    for seed, pick in zip((5, 6, 7), picks, strict=True):
        assert pick == [k for k in range(200) if documented_sample(seed, k, 0.5)]


# --- configuration, transport, validation -----------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "0.5", True, None])
@pytest.mark.parametrize("name", ["journey_sample_rate", "step_sample_rate", "rich_subsample_rate"])
def test_rates_outside_unit_interval_fail(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=name):
        EngineTracing(**{name: bad})
    with pytest.raises(ValueError, match=name):
        EngineTracingConfig(**tracing_settings(**{name: bad}))


def test_defaults_follow_the_spec() -> None:
    t = EngineTracing()
    assert (t.journey_sample_rate, t.step_enabled, t.step_sample_rate, t.rich_subsample_rate) == (
        1.0,
        False,
        0.01,
        0.001,
    )
    c = EngineTracingConfig(endpoint="http://x:4317")
    assert (c.journey_sample_rate, c.step_enabled, c.step_sample_rate, c.rich_subsample_rate, c.sampler) == (
        1.0,
        False,
        0.01,
        0.001,
        "random",
    )


def test_invalid_settings_stop_the_scheduler_from_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="step_sample_rate"):
        make_scheduler(monkeypatch, tracing_settings(step_enabled=True, step_sample_rate=2.0))
    with pytest.raises(ValueError, match="unknown keys"):
        make_scheduler(monkeypatch, tracing_settings(step_rate=1.0))


def _spec(tracing: EngineTracing) -> LLMEngineSpec:
    pipeline = load_pipeline()
    return LLMEngineSpec.for_replica(pipeline, pipeline.speech_stage, 0, tracing=tracing)


def test_no_exporter_means_no_engine_tracing() -> None:
    spec = _spec(EngineTracing(step_enabled=True))
    assert engine_tracing_config(spec, {}) is None
    assert engine_tracing_config(spec, {"OTEL_TRACES_EXPORTER": "console"}) is None
    assert (
        engine_tracing_config(spec, {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) is None
    )
    # configured, but nothing to trace
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    assert engine_tracing_config(_spec(EngineTracing(journey_sample_rate=0.0)), env) is None


def test_engine_settings_carry_every_flag_and_the_worker_endpoint() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    flags = EngineTracing(
        journey_sample_rate=0.25, step_enabled=True, step_sample_rate=0.5, rich_subsample_rate=0.75
    )
    cfg = engine_tracing_config(_spec(flags), env)
    assert cfg is not None
    assert (cfg.journey_sample_rate, cfg.step_enabled, cfg.step_sample_rate, cfg.rich_subsample_rate) == (
        0.25,
        True,
        0.5,
        0.75,
    )
    assert (cfg.endpoint, cfg.protocol) == ("http://c:4318/v1/traces", "http/protobuf")
    assert cfg.resource == {
        "omnirelay.pipeline": "omni",
        "omnirelay.stage": load_pipeline().speech_stage,
        "omnirelay.stage_name": "talker",
        "omnirelay.replica": 0,
    }
    # what travels in additional_config comes back unchanged in the EngineCore
    carried = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: cfg.to_dict(), "other": 1})
    assert EngineTracingConfig.from_vllm_config(carried) == cfg
    assert EngineTracingConfig.from_vllm_config(SimpleNamespace(additional_config={})) is None


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ("http://c:4317", "grpc")),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/x",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            },
            ("http://t:4318/x", "http/protobuf"),
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("http://localhost:4317", "grpc")),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
            ("http://localhost:4318/v1/traces", "http/protobuf"),
        ),
    ],
)
def test_traces_endpoint_resolution(env: dict[str, str], expected: tuple[str, str]) -> None:
    assert otlp_traces_endpoint(env) == expected


def test_scheduler_without_settings_has_no_tracing_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(monkeypatch, None)
    assert t.sched.journey_tracer is None and t.sched.step_tracer is None and t.sched._trace_provider is None
    add(t, "a", 20, 3)
    run_until_idle(t)
    t.sched.shutdown()
    assert t.spans() == []
