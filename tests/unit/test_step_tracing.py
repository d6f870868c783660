"""Scheduler step tracing and KV helpers (docs/contract.md, "Tracing") on a real
``OmniScheduler``, without an engine.

The scheduler is vLLM's, built from a real ``VllmConfig`` (the tiny thinker's model config) and a
small KV cache; a :class:`Driver` plays the model runner (one sampled token per finished prefill or
decode step). Spans go to an in-memory exporter instead of OTLP (:mod:`tests.scheduler_driver`).
"""

from __future__ import annotations

import itertools
import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.v1.request import RequestStatus

from services.stage_worker.engine_core.kv_observability import (
    PerRequestKVMetrics,
    StepKVSummary,
    get_per_request_kv_metrics,
    get_step_kv_summary,
)
from services.stage_worker.engine_core.step_tracing import (
    BATCH_SUMMARY_EVENT,
    BATCH_SUMMARY_OPTIONAL,
    BATCH_SUMMARY_REQUIRED,
    REQUEST_SNAPSHOT_EVENT,
    REQUEST_SNAPSHOT_OPTIONAL,
    REQUEST_SNAPSHOT_REQUIRED,
    STEP_SPAN_NAME,
    StepTracer,
    batch_summary_attributes,
)
from services.stage_worker.engine_core.tracing_config import (
    ADDITIONAL_CONFIG_KEY,
    EngineTracingConfig,
)
from tests.scheduler_driver import (
    Step,
    Traced,
    add,
    check_snapshot_invariants,
    check_summary_invariants,
    check_types,
    documented_sample,
    make_scheduler,
    run_until_idle,
    step,
    tracing_settings,
)

# --- step tracing ---------------------------------------------------------------------------------------


def test_step_tracing_disabled_creates_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(monkeypatch, tracing_settings(step_enabled=False, journey_sample_rate=0.0))
    assert t.sched.step_tracer is None and t.sched.journey_tracer is None
    add(t, "a", 20, 3)
    run_until_idle(t)
    t.sched.shutdown()
    assert t.spans() == []


def _workload(t: Traced) -> list[Step]:
    """Three requests (the last two share a prefix: prefix-cache hits), plus a late arrival."""
    shared = list(range(100, 148))  # three full blocks
    add(t, "a", 40, 6)
    add(t, "b", [*shared, 1, 2, 3], 4)
    steps = [step(t), step(t)]
    add(t, "c", [*shared, 4, 5], 5)
    steps += run_until_idle(t)
    return steps


def test_rate_one_summarizes_every_step_and_snapshots_every_running_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = make_scheduler(
        monkeypatch,
        tracing_settings(
            step_enabled=True, step_sample_rate=1.0, rich_subsample_rate=1.0, journey_sample_rate=0.0
        ),
    )
    steps = _workload(t)
    t.sched.shutdown()
    (span,) = t.spans(STEP_SPAN_NAME)
    assert span.parent is None and span.end_time is not None
    summaries = t.step_events(BATCH_SUMMARY_EVENT)
    snapshots = t.step_events(REQUEST_SNAPSHOT_EVENT)

    assert [s["step.id"] for s in summaries] == [st.step_id for st in steps] == list(range(1, len(steps) + 1))
    assert steps[-1].running == [] and summaries[-1]["batch.scheduled_tokens"] == 0  # an empty step
    for st, s in zip(steps, summaries, strict=True):
        check_types(s, BATCH_SUMMARY_REQUIRED, BATCH_SUMMARY_OPTIONAL)
        check_summary_invariants(s)
        out = st.output
        assert s["queue.running_depth"] == len(st.running)
        assert s["batch.scheduled_tokens"] == out.total_num_scheduled_tokens
        assert s["batch.num_finished"] == len(out.finished_req_ids)
        assert s["batch.num_preempted"] == len(out.preempted_req_ids or ())
        assert s["batch.num_prefill_reqs"] == sum(1 for r in st.running if st.tokens[r] == 0)
        assert s["kv.blocks_total_gpu"] == 64 - 1
        mine = [r for r in snapshots if r["step.id"] == st.step_id]
        assert sorted(r["request.id"] for r in mine) == sorted(st.running)
        for r in mine:
            check_types(r, REQUEST_SNAPSHOT_REQUIRED, REQUEST_SNAPSHOT_OPTIONAL)
            check_snapshot_invariants(r)
            assert r["request.scheduled_tokens_this_step"] == out.num_scheduled_tokens.get(r["request.id"], 0)
            assert r["kv.blocks_allocated_gpu"] > 0
    assert len(snapshots) == sum(len(st.running) for st in steps)
    # the prefix-cache hit of "c" shows as cached blocks and a shorter effective prompt
    c_first = next(r for r in snapshots if r["request.id"] == "c")
    assert c_first["kv.blocks_cached_gpu"] >= 3
    assert c_first["request.effective_prompt_len"] == 50 - 48
    assert c_first["request.max_tokens"] == 5
    # configuration reported by the span itself
    assert span.attributes["omnirelay.tracing.step_enabled"] is True
    assert span.attributes["omnirelay.tracing.step_sample_rate"] == 1.0
    assert span.attributes["omnirelay.tracing.rich_subsample_rate"] == 1.0


def test_rate_zero_emits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(
        monkeypatch,
        tracing_settings(
            step_enabled=True, step_sample_rate=0.0, rich_subsample_rate=1.0, journey_sample_rate=0.0
        ),
    )
    _workload(t)
    t.sched.shutdown()
    (span,) = t.spans(STEP_SPAN_NAME)
    assert list(span.events) == []


def test_rich_rate_zero_emits_summaries_only(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(
        monkeypatch,
        tracing_settings(
            step_enabled=True, step_sample_rate=1.0, rich_subsample_rate=0.0, journey_sample_rate=0.0
        ),
    )
    steps = _workload(t)
    t.sched.shutdown()
    assert len(t.step_events(BATCH_SUMMARY_EVENT)) == len(steps)
    assert t.step_events(REQUEST_SNAPSHOT_EVENT) == []


def test_two_stage_deterministic_sampling_picks_exactly_the_expected_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed, step_rate, rich_rate = 11, 0.6, 0.5
    t = make_scheduler(
        monkeypatch,
        tracing_settings(
            step_enabled=True,
            step_sample_rate=step_rate,
            rich_subsample_rate=rich_rate,
            journey_sample_rate=0.0,
            seed=seed,
        ),
    )
    add(t, "a", 30, 30)
    add(t, "b", 30, 30)
    steps = run_until_idle(t)
    t.sched.shutdown()
    # the documented rule, with the documented seeds: steps seed + 1, rich seed + 2
    expected = [st.step_id for st in steps if documented_sample(seed + 1, st.step_id, step_rate)]
    expected_rich = [k for k in expected if documented_sample(seed + 2, k, rich_rate)]
    assert 0 < len(expected_rich) < len(expected) < len(steps)
    assert [s["step.id"] for s in t.step_events(BATCH_SUMMARY_EVENT)] == expected
    by_step = {st.step_id: st for st in steps}
    snapshots = t.step_events(REQUEST_SNAPSHOT_EVENT)
    assert sorted({r["step.id"] for r in snapshots}) == [k for k in expected_rich if by_step[k].running]
    assert len(snapshots) == sum(len(by_step[k].running) for k in expected_rich)


def test_span_rotates_before_the_event_limit_without_losing_events() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    now = [0]
    tracer = StepTracer(
        provider.get_tracer("t"),
        1.0,
        1.0,
        span_attributes={"omnirelay.engine.pid": 1},
        max_events_per_span=5,
        max_span_age_s=10.0,
        clock_ns=lambda: now[0],
    )
    sched = SimpleNamespace(
        running=[],
        requests={},
        get_request_counts=lambda: (0, 0),
        kv_cache_manager=SimpleNamespace(
            block_pool=SimpleNamespace(num_gpu_blocks=9, get_num_free_blocks=lambda: 8, get_usage=lambda: 0.0)
        ),
    )
    out = SimpleNamespace(
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=set(), preempted_req_ids=set()
    )
    for k in range(1, 13):
        tracer.on_schedule_end(sched, out, k, 0)
    now[0] = 11 * 10**9  # older than max_span_age_s: the next summary opens a new span
    tracer.on_schedule_end(sched, out, 13, 0)
    tracer.close()
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.attributes["scheduler_steps.index"])
    assert [len(s.events) for s in spans] == [5, 5, 2, 1]
    assert [e.attributes["step.id"] for s in spans for e in s.events] == list(range(1, 14))
    for prev, cur in itertools.pairwise(spans):
        assert cur.links[0].context.span_id == prev.context.span_id
        assert cur.attributes["omnirelay.engine.pid"] == 1


def test_emission_failures_never_break_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(
        monkeypatch,
        tracing_settings(
            step_enabled=True, step_sample_rate=1.0, rich_subsample_rate=1.0, journey_sample_rate=1.0
        ),
    )

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("exporter on fire")

    steps_tracer, journey = t.sched.step_tracer, t.sched.journey_tracer
    assert steps_tracer is not None and journey is not None
    monkeypatch.setattr(steps_tracer.span, "add_event", boom)
    monkeypatch.setattr(journey, "sampler", boom)
    monkeypatch.setattr(journey.tracer, "start_span", boom)
    add(t, "a", 20, 4)
    add(t, "b", list(range(500, 520)), 4)
    steps = run_until_idle(t)
    assert sum(s.output.total_num_scheduled_tokens for s in steps) == 2 * 20 + 2 * 3
    assert not t.sched.requests
    t.sched.shutdown()


def test_shutdown_ends_the_span_and_later_steps_are_not_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(
        monkeypatch, tracing_settings(step_enabled=True, step_sample_rate=1.0, journey_sample_rate=0.0)
    )
    step(t)
    assert t.spans(STEP_SPAN_NAME) == []  # long-lived: still open
    t.sched.shutdown()
    (span,) = t.spans(STEP_SPAN_NAME)
    assert span.end_time is not None and len(span.events) == 1
    step(t)
    t.sched.shutdown()
    assert len(t.spans(STEP_SPAN_NAME)) == 1


# --- KV observability helpers ---------------------------------------------------------------------------


def test_kv_helpers_read_existing_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(monkeypatch, None, num_blocks=32)
    manager = t.sched.kv_cache_manager
    shared = list(range(200, 264))  # 4 full blocks
    add(t, "x", [*shared, 1], 3)
    step(t)
    x = t.sched.requests["x"]
    m = get_per_request_kv_metrics(x, manager)
    assert isinstance(m, PerRequestKVMetrics)
    assert m.blocks_allocated_gpu == 5  # ceil(65 / 16)
    assert m.blocks_cached_gpu == 4  # its full blocks, now in the prefix cache
    assert (m.blocks_cpu_offload, m.blocks_disk_offload) == (None, None)
    add(t, "y", [*shared, 2], 3)
    step(t)
    y = t.sched.requests["y"]
    my = get_per_request_kv_metrics(y, manager)
    assert my.blocks_allocated_gpu == 5 and my.blocks_cached_gpu == 4
    assert my.effective_prompt_len is None  # prefill stats went out with the first token
    # the helpers do not create entries for unknown requests
    ghost = SimpleNamespace(request_id="ghost", num_prompt_tokens=3)
    assert get_per_request_kv_metrics(ghost, manager) == PerRequestKVMetrics(0, 0)
    assert all("ghost" not in g.req_to_blocks for g in manager.coordinator.single_type_managers)

    s = get_step_kv_summary(manager.block_pool)
    assert isinstance(s, StepKVSummary)
    assert s.blocks_total_gpu == 31
    assert s.blocks_free_gpu == manager.block_pool.get_num_free_blocks()
    assert s.usage_gpu_ratio == pytest.approx(manager.usage)
    assert (s.blocks_cpu_offload, s.blocks_disk_offload) == (None, None)


def test_kv_helpers_never_raise() -> None:
    assert get_per_request_kv_metrics(SimpleNamespace(request_id="r"), None) == PerRequestKVMetrics(0, 0)
    assert get_per_request_kv_metrics(object(), SimpleNamespace()) == PerRequestKVMetrics(0, 0)
    assert get_step_kv_summary(None) == StepKVSummary(0, 0, 0.0)


def test_kv_helpers_leave_the_scheduler_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(monkeypatch, None)
    add(t, "a", 40, 4)
    step(t)
    manager = t.sched.kv_cache_manager
    groups = manager.coordinator.single_type_managers
    before = (
        [dict(g.req_to_blocks) for g in groups],
        [dict(g.num_cached_block) for g in groups],
        manager.block_pool.get_num_free_blocks(),
    )
    for _ in range(3):
        get_per_request_kv_metrics(t.sched.requests["a"], manager)
        get_step_kv_summary(manager.block_pool)
    after = (
        [dict(g.req_to_blocks) for g in groups],
        [dict(g.num_cached_block) for g in groups],
        manager.block_pool.get_num_free_blocks(),
    )
    assert before == after


def test_finished_status_names() -> None:
    from services.stage_worker.engine_core.journey_tracing import finish_status

    assert finish_status(SimpleNamespace(status=RequestStatus.FINISHED_LENGTH_CAPPED)) == "length_capped"
    assert finish_status(SimpleNamespace(status=RequestStatus.FINISHED_ABORTED)) == "aborted"


def test_shutdown_signal_ends_and_flushes_spans_once_drained(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the EngineCore, SIGTERM reaches vLLM's handler (here a stand-in) and, once the
    scheduler has drained, the spans are ended before the engine's teardown starts."""
    seen: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    sigint_before = signal.getsignal(signal.SIGINT)
    try:
        t = make_scheduler(monkeypatch, tracing_settings(step_enabled=True, step_sample_rate=1.0))
        assert signal.getsignal(signal.SIGINT) is sigint_before  # Python's default is left alone
        add(t, "a", 20, 50)
        step(t)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # as the OS would deliver it
        assert seen == [signal.SIGTERM]
        assert t.sched.has_requests() and t.spans() == []  # still busy: nothing ended
        t.sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # EngineCore's abort mode
        step(t)
        assert not t.sched.has_requests()
        (steps_span,) = t.spans(STEP_SPAN_NAME)
        assert steps_span.attributes["scheduler_steps.last"] is True
        (core,) = t.spans("llm_core")
        assert core.events[-1].name == "journey.FINISHED"
        assert core.events[-1].attributes["finish.status"] == "aborted"
        assert t.sched.step_tracer is None and t.sched.journey_tracer is None
        t.sched.shutdown()  # the regular hook afterwards is harmless
        assert len(t.spans()) == 2
    finally:
        signal.signal(signal.SIGTERM, original)


def test_build_args_carry_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.stage_worker.llm_engine import _with_tracing

    for key in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME"):
        monkeypatch.setenv(key, "")  # recorded, so the undo removes what _with_tracing sets
        monkeypatch.delenv(key)
    cfg = EngineTracingConfig(**tracing_settings(step_enabled=True))
    kwargs: dict[str, Any] = {"additional_config": {"gdn_prefill_backend": "triton"}}
    _with_tracing(kwargs, cfg)
    assert kwargs["additional_config"] == {
        "gdn_prefill_backend": "triton",
        ADDITIONAL_CONFIG_KEY: cfg.to_dict(),
    }
    assert kwargs["otlp_traces_endpoint"] == cfg.endpoint
    assert os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert os.environ["OTEL_SERVICE_NAME"] == "omnirelay-engine"
    with pytest.raises(ValueError, match="additional_config"):
        _with_tracing({"additional_config": "nope"}, cfg)


def _summary(running: list[Any], scheduled: dict[str, int], requests: dict[str, Any]) -> dict[str, Any]:
    output = SimpleNamespace(
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(),
        preempted_req_ids=None,
    )
    kv = StepKVSummary(blocks_total_gpu=10, blocks_free_gpu=10, usage_gpu_ratio=0.0)
    return batch_summary_attributes(
        step_id=1,
        ts_start_ns=0,
        ts_end_ns=1000,
        running=running,
        num_waiting=0,
        output=output,
        requests=requests,
        kv=kv,
    )


def test_each_side_of_the_split_is_counted_on_its_own() -> None:
    """docs/contract.md, "Tracing": prefill where no output token yet, decode where some; each
    counted by its own rule, so the invariants check the counts."""
    reqs = {f"p{i}": SimpleNamespace(num_output_tokens=0) for i in range(2)}
    reqs |= {f"d{i}": SimpleNamespace(num_output_tokens=i + 1) for i in range(3)}
    scheduled = {"p0": 16, "p1": 7, "d0": 1, "d1": 1, "d2": 1}
    s = _summary(list(reqs.values()), scheduled, reqs)
    assert (s["batch.num_prefill_reqs"], s["batch.num_decode_reqs"]) == (2, 3)
    assert (s["batch.prefill_tokens"], s["batch.decode_tokens"], s["batch.scheduled_tokens"]) == (23, 3, 26)
    check_summary_invariants(s)


def test_the_invariants_catch_a_scheduled_request_counted_on_neither_side() -> None:
    reqs = {"p0": SimpleNamespace(num_output_tokens=0), "d0": SimpleNamespace(num_output_tokens=4)}
    s = _summary(list(reqs.values()), {"p0": 5, "d0": 1, "unknown": 3}, reqs)
    assert (s["batch.prefill_tokens"], s["batch.decode_tokens"], s["batch.scheduled_tokens"]) == (5, 1, 9)
    with pytest.raises(AssertionError):
        check_summary_invariants(s)
