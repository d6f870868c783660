"""Tracing inside real vLLM engines (tiny thinker, CPU): journey and step tracing (docs/contract.md,
"Tracing").

Spans travel over OTLP/HTTP to an in-process receiver, from this process (the "worker" spans the
test starts per request) and from each engine's EngineCore process (journey and step spans).
Two engines in the whole file:

- engine A: a tiny KV cache (12 blocks of 32 tokens) so two long requests cannot both fit and one
  is preempted; journey tracing at 0.5 and step tracing at 1.0 / 1.0, with sha1 samplers, so the
  test knows exactly which requests and steps must show up;
- engine B: journey 0, step tracing on at rate 0, rich rate 0.37: nothing but the span.

Each engine's ``scheduler_steps`` span reports the settings as the scheduler received them, and the
EngineCore's pid: the flags are observed from inside the EngineCore process.

The "worker" spans stand in for the worker's per-request stage spans (``req.span``); the journey
span (``llm_core``) must be their child, in the same trace.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from opentelemetry.trace import Span
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from libs.common import tracing
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, PipelineConfig, load_pipeline
from libs.stack.processes import wait_for
from services.stage_worker.engine_core.step_tracing import (
    BATCH_SUMMARY_EVENT,
    BATCH_SUMMARY_REQUIRED,
    REQUEST_SNAPSHOT_EVENT,
    REQUEST_SNAPSHOT_REQUIRED,
    SPAN_INDEX,
    SPAN_LAST,
    STEP_SPAN_NAME,
)
from services.stage_worker.engine_core.tracing_config import ENGINE_SERVICE_NAME, EngineTracing
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.handlers.thinker import ThinkerHandler
from services.stage_worker.llm_engine import LLMEngineSpec
from tests.otlp_receiver import Receiver, SpanRecord, start_receiver, tracing_in_this_process
from tests.scheduler_driver import documented_sample

pytestmark = pytest.mark.integration
TEXT_ONLY = DEFAULT_PIPELINE_PATH.with_name("text-only.yaml")
"""A thinker alone at stage 0: these tests drive its engine directly."""

SEED = 0
A = EngineTracing(
    journey_sample_rate=0.5,
    step_enabled=True,
    step_sample_rate=1.0,
    rich_subsample_rate=1.0,
    sampler="sha1",
    seed=SEED,
)
B = EngineTracing(
    journey_sample_rate=0.0,
    step_enabled=True,
    step_sample_rate=0.0,
    rich_subsample_rate=0.37,
    sampler="sha1",
    seed=SEED,
)
TINY_KV = {"block_size": 32, "num_gpu_blocks_override": 12}
"""11 usable blocks of 32 tokens: 352 tokens for everything running."""
LONG_PROMPT, LONG_MAX = 60, 150
"""Two such requests need 2 x 7 blocks at the end: one must be preempted."""


# --- set-up -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def otlp() -> Iterator[Receiver]:
    server, receiver = start_receiver()
    host, port = server.server_address[:2]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://{host}:{port}")
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        # set in os.environ by build_async_llm and by vLLM's tracer set-up: setenv first, so that
        # the undo also removes them when they were absent before (delenv alone records nothing)
        for key in (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_SERVICE_NAME",
            "OTEL_TRACES_EXPORTER",
            "OTEL_SDK_DISABLED",
        ):
            mp.setenv(key, "")
            mp.delenv(key)
        try:
            with tracing_in_this_process("worker", "omni", 0, 0):  # the "worker" side of this process
                yield receiver
        finally:
            server.shutdown()


def pipeline_for_test() -> PipelineConfig:
    p = load_pipeline(TEXT_ONLY)
    thinker = p.stages[0]
    engine = thinker.engine.model_copy(update={"max_model_len": 256, "extra": dict(TINY_KV)})
    return p.model_copy(update={"stages": [thinker.model_copy(update={"engine": engine}), *p.stages[1:]]})


def spec_with(flags: EngineTracing) -> LLMEngineSpec:
    return LLMEngineSpec.for_replica(pipeline_for_test(), 0, 0, tracing=flags)


def engine_pid(handler: LLMHandler) -> int:
    return handler.engine.engine_core.resources.engine_manager.processes[0].pid


def request_span(name: str) -> Span:
    """A stand-in for the worker's per-request stage span."""
    return tracing.start_span(name, attributes={"omnirelay.request_id": name})


def trace_hex(span: Span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def span_hex(span: Span) -> str:
    return format(span.get_span_context().span_id, "016x")


async def generate(handler: LLMHandler, prompt: list[int], max_tokens: int, parent: Span) -> int:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    final = None
    headers = handler.trace_headers(parent)
    assert headers and headers["traceparent"].split("-")[1] == trace_hex(parent)
    async for out in handler.engine.generate(
        TokensPrompt(prompt_token_ids=prompt), params, uuid.uuid4().hex, trace_headers=headers
    ):
        final = out
    assert final is not None and final.finished
    return len(final.outputs[0].token_ids)


def spans_where(otlp: Receiver, pred, n: int, timeout_s: float = 20.0) -> list[SpanRecord]:
    deadline = time.monotonic() + timeout_s
    while True:
        with otlp.lock:
            got = [s for s in otlp.spans if pred(s)]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def step_spans(otlp: Receiver, pid: int, timeout_s: float = 20.0) -> list[SpanRecord]:
    """Every scheduler_steps span of the EngineCore ``pid``, once the last one (ended by engine
    shutdown) and all before it have arrived."""

    def all_arrived() -> list[SpanRecord] | None:
        with otlp.lock:
            got = [
                s
                for s in otlp.spans
                if s.name == STEP_SPAN_NAME and s.attributes.get("omnirelay.engine.pid") == pid
            ]
        last = [s.attributes[SPAN_INDEX] for s in got if s.attributes.get(SPAN_LAST)]
        if last and sorted(s.attributes[SPAN_INDEX] for s in got) == list(range(last[0] + 1)):
            return got
        return None

    try:
        return wait_for(all_arrived, f"every scheduler_steps span of pid {pid}", timeout_s, every_s=0.1)
    except RuntimeError as e:
        with otlp.lock:
            seen = [(s.name, s.service, s.attributes.get("omnirelay.engine.pid")) for s in otlp.spans]
        raise AssertionError(f"{e}; seen {seen}") from None


def parents_in_trace(rate: float, want: bool, n: int) -> list[Span]:
    """``n`` request spans whose trace the journey sampler must (``want``) or must not sample: by
    the documented rule (sha1 of ``"<seed>:<trace id>"``, the journey sampler's seed being the
    settings' own), computed in the test."""
    out: list[Span] = []
    while len(out) < n:
        span = request_span(f"omni.stage thinker #{len(out)}")
        if documented_sample(SEED, trace_hex(span), rate) == want:
            out.append(span)
        else:
            span.end()
    return out


# --- engine A -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def engine_a(otlp: Receiver) -> AsyncIterator[SimpleNamespace]:
    handler = ThinkerHandler(spec_with(A))
    t0 = time.monotonic()
    await handler.start()
    print(f"\nengine A: start {time.monotonic() - t0:.1f} s")
    pid = engine_pid(handler)
    assert pid != os.getpid()
    # vLLM's frontend llm_request span asserts stats that do not exist with log_stats off: it
    # must be off, or the first finished request kills the output handler (the workload below
    # would hang or fail).
    assert handler.engine.output_processor.tracing_enabled is False
    try:
        t0 = time.monotonic()
        long_parents = parents_in_trace(A.journey_sample_rate, True, 2)
        skipped_parents = parents_in_trace(A.journey_sample_rate, False, 3)
        prompts = [[10 + (37 * i + 11 * k) % 1500 for i in range(LONG_PROMPT)] for k in range(2)]
        done = await asyncio.gather(
            *(generate(handler, p, LONG_MAX, parent) for p, parent in zip(prompts, long_parents, strict=True))
        )
        assert done == [LONG_MAX, LONG_MAX]
        for k, parent in enumerate(skipped_parents):
            await generate(handler, [5 + k, 6, 7, 8, 9, 10], 4, parent)
        for parent in (*long_parents, *skipped_parents):
            parent.end()
        print(f"engine A: workload {time.monotonic() - t0:.2f} s")
    finally:
        t0 = time.monotonic()
        await handler.stop()  # EngineCore shutdown ends scheduler_steps and flushes
        print(f"engine A: stop {time.monotonic() - t0:.1f} s")
    steps = step_spans(otlp, pid)
    yield SimpleNamespace(pid=pid, long=long_parents, skipped=skipped_parents, step_spans=steps)


def journey_of(otlp: Receiver, parent: Span, timeout_s: float = 20.0) -> SpanRecord | None:
    got = spans_where(
        otlp, lambda s: s.name == "llm_core" and s.trace_id == trace_hex(parent), 1, timeout_s=timeout_s
    )
    assert len(got) <= 1
    return got[0] if got else None


def kinds(span: SpanRecord) -> list[str]:
    return [name.removeprefix("journey.") for name, _ in span.events]


class TestEngineA:
    def test_flags_reach_the_scheduler_inside_the_engine_core(self, engine_a: SimpleNamespace) -> None:
        assert engine_a.step_spans, "no scheduler_steps span from engine A"
        for span in engine_a.step_spans:
            assert span.service == ENGINE_SERVICE_NAME and span.parent_span_id == ""
            a = span.attributes
            assert a["omnirelay.engine.pid"] == engine_a.pid != os.getpid()
            assert a["omnirelay.tracing.journey_sample_rate"] == 0.5
            assert a["omnirelay.tracing.step_enabled"] is True
            assert a["omnirelay.tracing.step_sample_rate"] == 1.0
            assert a["omnirelay.tracing.rich_subsample_rate"] == 1.0
            assert a["omnirelay.tracing.sampler"] == "sha1"

    def test_preempted_request_journey_in_the_request_trace(
        self, otlp: Receiver, engine_a: SimpleNamespace
    ) -> None:
        journeys = [journey_of(otlp, p) for p in engine_a.long]
        assert all(journeys), "a sampled request has no llm_core span"
        preempted = [j for j in journeys if "PREEMPTED" in kinds(j)]
        assert preempted, [kinds(j) for j in journeys]
        for parent, j in zip(engine_a.long, journeys, strict=True):
            assert j is not None
            # a child of the worker's request span: same trace, parent = that span
            assert j.service == ENGINE_SERVICE_NAME
            assert (j.trace_id, j.parent_span_id) == (trace_hex(parent), span_hex(parent))
            assert j.attributes["journey.sample_rate"] == 0.5
            assert kinds(j)[:3] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN"] and kinds(j)[-1] == "FINISHED"
            stamps = [a["ts.monotonic_ns"] for _, a in j.events]
            assert stamps == sorted(stamps)
            for _, a in j.events:
                assert isinstance(a["ts.monotonic_ns"], int) and isinstance(a["ts.monotonic"], float)
                assert abs(a["ts.monotonic"] * 1e6 - a["ts.monotonic_ns"] // 1000) <= 1.0
                assert isinstance(a["scheduler.step"], int)
            assert j.events[-1][1]["decode.done_tokens"] == LONG_MAX
        j = preempted[0]
        k = kinds(j)
        assert k[:4] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "PREEMPTED"]
        assert k[-2:] == ["SCHEDULED", "FINISHED"]
        resumed = [a for name, a in j.events if name == "journey.SCHEDULED"][1:]
        assert resumed and all(a["schedule.kind"] == "RESUME" for a in resumed)
        assert j.attributes["num_preemptions"] == k.count("PREEMPTED") >= 1
        # the worker span is in the same trace
        (worker,) = [s for s in otlp.trace(j.trace_id) if s.span_id == j.parent_span_id]
        assert worker.service == "omnirelay-worker"

    def test_unsampled_requests_have_no_journey(self, otlp: Receiver, engine_a: SimpleNamespace) -> None:
        for parent in engine_a.skipped:
            assert journey_of(otlp, parent, timeout_s=0.0) is None  # all flushed at engine stop
            assert any(s.span_id == span_hex(parent) for s in otlp.trace(trace_hex(parent)))  # exported

    def test_every_step_is_summarized_with_snapshots_of_every_running_request(
        self, engine_a: SimpleNamespace
    ) -> None:
        spans = sorted(engine_a.step_spans, key=lambda s: s.attributes["scheduler_steps.index"])
        assert [s.attributes["scheduler_steps.index"] for s in spans] == list(range(len(spans)))
        summaries = [a for s in spans for name, a in s.events if name == BATCH_SUMMARY_EVENT]
        snapshots = [a for s in spans for name, a in s.events if name == REQUEST_SNAPSHOT_EVENT]
        ids = [s["step.id"] for s in summaries]
        assert ids == list(range(1, len(ids) + 1)), "a step without its summary"
        assert len(ids) >= LONG_MAX
        for s in summaries:
            for name, typ in BATCH_SUMMARY_REQUIRED.items():
                assert type(s[name]) is typ, (name, s)
            assert s["batch.num_prefill_reqs"] + s["batch.num_decode_reqs"] == s["queue.running_depth"]
            assert s["batch.prefill_tokens"] + s["batch.decode_tokens"] == s["batch.scheduled_tokens"]
            assert 0.0 <= s["kv.usage_gpu_ratio"] <= 1.0
            assert 0 <= s["kv.blocks_free_gpu"] <= s["kv.blocks_total_gpu"] == 11
            assert s["step.duration_us"] >= 0
        assert any(s["batch.num_preempted"] > 0 for s in summaries)
        assert any(s["batch.scheduled_tokens"] == 0 for s in summaries)  # empty steps included
        assert max(s["queue.running_depth"] for s in summaries) == 2
        per_step: dict[int, int] = {}
        for r in snapshots:
            for name, typ in REQUEST_SNAPSHOT_REQUIRED.items():
                assert type(r[name]) is typ, (name, r)
            assert r["request.phase"] in {"PREFILL", "DECODE"}
            assert r["kv.blocks_allocated_gpu"] >= r["kv.blocks_cached_gpu"] >= 0
            assert r["kv.blocks_allocated_gpu"] > 0
            per_step[r["step.id"]] = per_step.get(r["step.id"], 0) + 1
        assert per_step == {
            s["step.id"]: s["queue.running_depth"] for s in summaries if s["queue.running_depth"]
        }


# --- engine B -------------------------------------------------------------------------------------------


async def test_engine_b_rate_zero_emits_no_step_event(otlp: Receiver) -> None:
    handler = ThinkerHandler(spec_with(B))
    t0 = time.monotonic()
    await handler.start()
    print(f"\nengine B: start {time.monotonic() - t0:.1f} s")
    pid = engine_pid(handler)
    parents = [request_span(f"omni.stage thinker B{k}") for k in range(3)]
    try:
        for k, parent in enumerate(parents):
            assert await generate(handler, [20 + k, 21, 22, 23], 8, parent) == 8
            parent.end()
    finally:
        await handler.stop()
    (span,) = step_spans(otlp, pid)
    a = span.attributes
    assert a["omnirelay.tracing.journey_sample_rate"] == 0.0
    assert a["omnirelay.tracing.step_enabled"] is True
    assert a["omnirelay.tracing.step_sample_rate"] == 0.0
    assert a["omnirelay.tracing.rich_subsample_rate"] == 0.37
    assert span.events == []
    for parent in parents:
        assert journey_of(otlp, parent, timeout_s=0.0) is None
