"""Journey events and journey sampling (docs/contract.md, "Tracing") on a real ``OmniScheduler``.

Same harness as ``test_step_tracing.py`` (:mod:`tests.scheduler_driver`): vLLM's scheduler, a fake model runner, spans in memory.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from vllm.v1.request import RequestStatus

from services.stage_worker.engine_core.journey_tracing import (
    CORE_SPAN_NAME,
    JourneyTracer,
    monotonic_pair,
    sampling_key,
)
from tests.scheduler_driver import (
    Traced,
    add,
    documented_sample,
    make_scheduler,
    run_until_idle,
    step,
    tracing_settings,
)

KINDS = ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "PREEMPTED", "FINISHED"]


def journey_scheduler(monkeypatch: pytest.MonkeyPatch, rate: float, **kw) -> Traced:
    return make_scheduler(monkeypatch, tracing_settings(journey_sample_rate=rate, seed=3), **kw)


def journeys(t: Traced) -> dict[str, list[tuple[str, dict]]]:
    """Request id → [(event kind, attributes)] of every ended llm_core span."""
    return {
        s.attributes["gen_ai.request.id"]: [
            (e.name.removeprefix("journey."), dict(e.attributes)) for e in s.events
        ]
        for s in t.spans(CORE_SPAN_NAME)
    }


def kinds(events: list[tuple[str, dict]]) -> list[str]:
    return [k for k, _ in events]


def test_rate_one_traces_every_request_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    t = journey_scheduler(monkeypatch, 1.0)
    for i in range(4):
        add(t, f"r{i}", list(range(30 * i + 100, 30 * i + 120)), 3)
    run_until_idle(t)
    got = journeys(t)
    assert sorted(got) == ["r0", "r1", "r2", "r3"]
    for events in got.values():
        assert kinds(events) == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
        _, sched = events[1]
        assert sched["schedule.kind"] == "FIRST" and sched["phase"] == "PREFILL"
        assert sched["prefill.done_tokens"] == 0 and sched["prefill.total_tokens"] == 20
        _, first = events[2]
        assert first["phase"] == "DECODE" and first["decode.done_tokens"] == 1
        assert first["prefill.done_tokens"] == 20
        _, fin = events[3]
        assert fin["finish.status"] == "length_capped" and fin["decode.done_tokens"] == 3
        assert fin["decode.max_tokens"] == 3 and fin["num_preemptions"] == 0
    for span in t.spans(CORE_SPAN_NAME):
        assert span.kind == SpanKind.INTERNAL and span.parent is None  # no trace headers: a root
        assert span.attributes["journey.sample_rate"] == 1.0
        assert span.attributes["gen_ai.usage.completion_tokens"] == 3
    assert t.sched._journey_sampled_requests == set()


def test_rate_zero_creates_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_scheduler(
        monkeypatch, tracing_settings(journey_sample_rate=0.0, step_enabled=True, step_sample_rate=0.0)
    )
    assert t.sched.journey_tracer is None
    add(t, "a", 20, 3)
    add(t, "b", list(range(300, 320)), 3)
    steps = run_until_idle(t)
    assert sum(s.output.total_num_scheduled_tokens for s in steps) == 2 * 20 + 2 * 2
    t.sched.shutdown()
    assert t.spans(CORE_SPAN_NAME) == []


def test_deterministic_sampler_traces_exactly_the_expected_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    rate = 0.5
    t = journey_scheduler(monkeypatch, rate, num_blocks=256)
    ids = [f"req-{i}" for i in range(12)]
    for i, rid in enumerate(ids):
        add(t, rid, list(range(40 * i + 100, 40 * i + 110)), 2)
    # the documented rule (journey sampler: the settings' seed, 3), keyed by request id here
    expected = [r for r in ids if documented_sample(3, r, rate)]
    assert 0 < len(expected) < len(ids)
    assert t.sched._journey_sampled_requests == set(expected)
    run_until_idle(t)
    assert sorted(journeys(t)) == sorted(expected)
    assert all(kinds(ev) == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"] for ev in journeys(t).values())
    assert not t.sched.requests  # unsampled requests completed too
    assert t.sched._journey_sampled_requests == set()


def test_sampling_follows_the_trace_and_the_span_joins_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rate = 0.5
    t = journey_scheduler(monkeypatch, rate)
    trace_ids = [f"{i:032x}" for i in range(1, 40)]
    names = [f"n{i}" for i in range(40)]
    # a request whose own id would not be sampled, in a trace that is; and the reverse (the
    # documented rule, seed 3, decides which)
    rid_in = next(n for n in names if not documented_sample(3, n, rate))
    rid_out = next(n for n in names if documented_sample(3, n, rate))
    tid = next(x for x in trace_ids if documented_sample(3, x, rate))
    skipped = next(x for x in trace_ids if not documented_sample(3, x, rate))
    add(t, rid_in, 20, 2, headers={"traceparent": f"00-{tid}-00000000000000aa-01"})
    add(t, rid_out, list(range(300, 320)), 2, headers={"traceparent": f"00-{skipped}-00000000000000bb-01"})
    run_until_idle(t)
    (span,) = t.spans(CORE_SPAN_NAME)
    assert span.attributes["gen_ai.request.id"] == rid_in
    assert format(span.context.trace_id, "032x") == tid
    assert span.parent is not None and span.parent.span_id == 0xAA and span.parent.is_remote
    assert sampling_key("r", {"traceparent": f"00-{tid}-00000000000000aa-01"}) == tid
    assert sampling_key("r", {"traceparent": "garbage"}) == "r" and sampling_key("r", None) == "r"


def test_dual_timestamps_come_from_one_clock_read(monkeypatch: pytest.MonkeyPatch) -> None:
    t = journey_scheduler(monkeypatch, 1.0)
    before = time.monotonic_ns()
    add(t, "a", 20, 2)
    run_until_idle(t)
    after = time.monotonic_ns()
    events = journeys(t)["a"]
    assert kinds(events) == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    previous = 0
    for _, attrs in events:
        s, ns = attrs["ts.monotonic"], attrs["ts.monotonic_ns"]
        assert type(s) is float and type(ns) is int
        assert abs(s * 1e6 - ns // 1000) <= 1.0  # same instant: within 1 µs
        assert before <= ns <= after and ns >= previous
        previous = ns
        assert type(attrs["scheduler.step"]) is int
    fixed = monotonic_pair(lambda: 1_234_567_890_123_456)
    assert fixed == (1234567.890123456, 1_234_567_890_123_456)


def test_step_ids_name_the_step_of_each_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    t = journey_scheduler(monkeypatch, 1.0)
    step(t)  # an empty step first
    add(t, "a", 20, 3)
    steps = run_until_idle(t)
    ev = dict(journeys(t)["a"])
    assert ev["QUEUED"]["scheduler.step"] == 1  # the last step before it arrived
    assert ev["SCHEDULED"]["scheduler.step"] == steps[0].step_id == 2
    assert ev["FIRST_TOKEN"]["scheduler.step"] == 2  # the prefill step produced it
    assert ev["FINISHED"]["scheduler.step"] == 4


def test_preempted_request_shows_every_kind_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 blocks of 16 tokens (7 usable): two 40-token prompts decoding 40 tokens each cannot both fit.
    t = journey_scheduler(monkeypatch, 1.0, num_blocks=8, prefix_caching=False)
    add(t, "a", 40, 40)
    add(t, "b", list(range(300, 340)), 40)
    run_until_idle(t)
    got = journeys(t)
    preempted = [rid for rid, ev in got.items() if "PREEMPTED" in kinds(ev)]
    assert preempted, got
    ev = got[preempted[0]]
    assert kinds(ev)[:4] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "PREEMPTED"]
    assert kinds(ev)[-2:] == ["SCHEDULED", "FINISHED"]
    assert set(kinds(ev)) == set(KINDS)
    scheduled = [a for k, a in ev if k == "SCHEDULED"]
    assert [a["schedule.kind"] for a in scheduled] == ["FIRST"] + ["RESUME"] * (len(scheduled) - 1)
    pre = next(a for k, a in ev if k == "PREEMPTED")
    assert pre["num_preemptions"] == 1 and pre["phase"] == "WAITING"
    assert pre["prefill.done_tokens"] == 0  # its KV was freed
    assert pre["decode.done_tokens"] > 0  # generated tokens survive preemption
    assert ev[-1][1]["finish.status"] == "length_capped" and ev[-1][1]["decode.done_tokens"] == 40
    stamps = [a["ts.monotonic_ns"] for _, a in ev]
    assert stamps == sorted(stamps)
    assert t.sched._journey_sampled_requests == set()


def test_first_token_precedes_finished_when_they_coincide(monkeypatch: pytest.MonkeyPatch) -> None:
    t = journey_scheduler(monkeypatch, 1.0)
    add(t, "one", 20, 1)
    run_until_idle(t)
    assert kinds(journeys(t)["one"]) == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]


def test_sampled_set_is_empty_after_aborts_and_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    t = journey_scheduler(monkeypatch, 1.0, max_num_seqs=1)
    add(t, "running", 20, 50)
    add(t, "waiting", list(range(300, 320)), 50)
    step(t)
    step(t)
    assert t.sched._journey_sampled_requests == {"running", "waiting"}
    t.sched.finish_requests(["running", "waiting"], RequestStatus.FINISHED_ABORTED)
    assert t.sched._journey_sampled_requests == set()
    assert t.sched.journey_tracer is not None and not t.sched.journey_tracer.awaiting_first_token
    got = journeys(t)
    assert kinds(got["waiting"]) == ["QUEUED", "FINISHED"]
    assert got["waiting"][-1][1]["finish.status"] == "aborted"
    assert kinds(got["running"]) == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    run_until_idle(t)

    add(t, "in-flight", 20, 50)
    step(t)
    t.sched.shutdown()
    assert t.sched._journey_sampled_requests == set()
    (span,) = [s for s in t.spans(CORE_SPAN_NAME) if s.attributes["gen_ai.request.id"] == "in-flight"]
    assert span.attributes["journey.incomplete"] is True and span.end_time is not None


def test_journey_failures_never_break_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    t = journey_scheduler(monkeypatch, 1.0)
    journey = t.sched.journey_tracer
    assert journey is not None
    add(t, "a", 20, 3)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no")

    monkeypatch.setattr(journey.sampled["a"].span, "add_event", boom)
    add(t, "b", list(range(300, 320)), 3)
    run_until_idle(t)
    assert not t.sched.requests
    assert kinds(journeys(t)["b"]) == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    assert t.sched._journey_sampled_requests == set()


def test_journey_rate_is_validated() -> None:
    provider = TracerProvider()
    with pytest.raises(ValueError, match="journey_sample_rate"):
        JourneyTracer(provider.get_tracer("t"), 1.01)
    with pytest.raises(ValueError, match="journey_sample_rate"):
        JourneyTracer(provider.get_tracer("t"), -1)
