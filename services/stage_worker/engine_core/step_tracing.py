"""Scheduler step tracing: the ``scheduler_steps`` span and its two events (docs/engine-tracing.md).

At the end of every ``schedule()`` the scheduler offers the step to :class:`StepTracer`: sampled at
``step_sample_rate`` (keyed by the step id, the scheduler's ``current_step``), the step adds one
``step.BATCH_SUMMARY`` event, empty steps included; of those, sampled at ``rich_subsample_rate`` (an
independent sampler), one ``step.REQUEST_SNAPSHOT`` event per running request, with the same
``step.id``. Payloads use only what the scheduler has, and the read-only KV helpers of
:mod:`.kv_observability`.

The span (SpanKind.INTERNAL, always a root span) carries the tracing settings as attributes. The
OpenTelemetry SDK exports a span only when it ends and keeps at most ``OTEL_SPAN_EVENT_COUNT_LIMIT``
(128) events, so the tracer rotates: at that many events, or when a summary is due on a span older
than ``max_span_age_s``, a new span (linked to the previous one, ``scheduler_steps.index`` + 1)
takes over. :meth:`StepTracer.close` (engine shutdown) ends the last. Failures are contained.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Tracer

from services.stage_worker.engine_core.kv_observability import (
    PerRequestKVMetrics,
    StepKVSummary,
    get_per_request_kv_metrics,
    get_step_kv_summary,
)
from services.stage_worker.engine_core.tracing_config import Sampler, random_sampler, validate_rate

log = logging.getLogger("vllm.omnirelay.step_tracing")
"""Under ``vllm.``: vLLM's logging set-up prints it in the EngineCore, prefixed with the process."""

STEP_SPAN_NAME = "scheduler_steps"
BATCH_SUMMARY_EVENT = "step.BATCH_SUMMARY"
REQUEST_SNAPSHOT_EVENT = "step.REQUEST_SNAPSHOT"
SPAN_INDEX = "scheduler_steps.index"
"""0, 1, ...: position of a span in the engine's sequence of scheduler_steps spans."""
SPAN_LAST = "scheduler_steps.last"
"""True on the span ended by engine shutdown (the engine's last one)."""

DEFAULT_MAX_SPAN_AGE_S = 30.0
_DEFAULT_EVENT_LIMIT = 128  # the SDK's default OTEL_SPAN_EVENT_COUNT_LIMIT

BATCH_SUMMARY_REQUIRED: dict[str, type] = {
    "step.id": int,
    "step.ts_start_ns": int,
    "step.ts_end_ns": int,
    "step.duration_us": int,
    "queue.running_depth": int,
    "queue.waiting_depth": int,
    "batch.num_prefill_reqs": int,
    "batch.num_decode_reqs": int,
    "batch.scheduled_tokens": int,
    "batch.prefill_tokens": int,
    "batch.decode_tokens": int,
    "batch.num_finished": int,
    "batch.num_preempted": int,
    "kv.usage_gpu_ratio": float,
    "kv.blocks_total_gpu": int,
    "kv.blocks_free_gpu": int,
}
"""The batch summary's required attributes and their types."""

BATCH_SUMMARY_OPTIONAL: dict[str, type] = {"kv.blocks_cpu_offload": int, "kv.blocks_disk_offload": int}

REQUEST_SNAPSHOT_REQUIRED: dict[str, type] = {
    "step.id": int,
    "request.id": str,
    "request.phase": str,
    "request.num_prompt_tokens": int,
    "request.num_computed_tokens": int,
    "request.num_output_tokens": int,
    "request.num_preemptions": int,
    "request.scheduled_tokens_this_step": int,
    "kv.blocks_allocated_gpu": int,
    "kv.blocks_cached_gpu": int,
}
"""The request snapshot's required attributes and their types."""

REQUEST_SNAPSHOT_OPTIONAL: dict[str, type] = {
    "kv.blocks_cpu_offload": int,
    "kv.blocks_disk_offload": int,
    "request.max_tokens": int,
    "request.effective_prompt_len": int,
}


def batch_summary_attributes(
    *,
    step_id: int,
    ts_start_ns: int,
    ts_end_ns: int,
    running: list[Any],
    num_waiting: int,
    output: Any,
    requests: Mapping[str, Any],
    kv: StepKVSummary,
) -> dict[str, int | float]:
    """The ``step.BATCH_SUMMARY`` payload. Prefill (``num_output_tokens == 0``) and decode
    (``> 0``) are each counted on their own, so the contract's invariants (prefill + decode =
    running depth, = scheduled tokens) check the counts; an unknown scheduled request is in neither."""
    num_prefill = sum(1 for req in running if req.num_output_tokens == 0)
    num_decode = sum(1 for req in running if req.num_output_tokens > 0)
    prefill_tokens = decode_tokens = 0
    for rid, n in output.num_scheduled_tokens.items():
        req = requests.get(rid)
        if req is None:
            continue
        if req.num_output_tokens == 0:
            prefill_tokens += n
        if req.num_output_tokens > 0:
            decode_tokens += n
    preempted = output.preempted_req_ids
    attrs: dict[str, int | float] = {
        "step.id": step_id,
        "step.ts_start_ns": ts_start_ns,
        "step.ts_end_ns": ts_end_ns,
        "step.duration_us": max(ts_end_ns - ts_start_ns, 0) // 1000,
        "queue.running_depth": len(running),
        "queue.waiting_depth": num_waiting,
        "batch.num_prefill_reqs": num_prefill,
        "batch.num_decode_reqs": num_decode,
        "batch.scheduled_tokens": output.total_num_scheduled_tokens,
        "batch.prefill_tokens": prefill_tokens,
        "batch.decode_tokens": decode_tokens,
        "batch.num_finished": len(output.finished_req_ids),
        "batch.num_preempted": len(preempted) if preempted else 0,
        "kv.usage_gpu_ratio": kv.usage_gpu_ratio,
        "kv.blocks_total_gpu": kv.blocks_total_gpu,
        "kv.blocks_free_gpu": kv.blocks_free_gpu,
    }
    return _with_offloads(attrs, kv)


def _with_offloads(attrs: dict[str, Any], kv: StepKVSummary | PerRequestKVMetrics) -> dict[str, Any]:
    """``attrs`` with ``kv``'s optional offload counts, those it has."""
    for name in ("blocks_cpu_offload", "blocks_disk_offload"):
        if (n := getattr(kv, name)) is not None:
            attrs[f"kv.{name}"] = n
    return attrs


def request_snapshot_attributes(
    request: Any, *, step_id: int, output: Any, kv: PerRequestKVMetrics
) -> dict[str, int | str]:
    """The ``step.REQUEST_SNAPSHOT`` payload of one running request."""
    n_out = request.num_output_tokens
    attrs: dict[str, int | str] = {
        "step.id": step_id,
        "request.id": request.request_id,
        "request.phase": "PREFILL" if n_out == 0 else "DECODE",
        "request.num_prompt_tokens": request.num_prompt_tokens,
        "request.num_computed_tokens": request.num_computed_tokens,
        "request.num_output_tokens": n_out,
        "request.num_preemptions": request.num_preemptions,
        "request.scheduled_tokens_this_step": output.num_scheduled_tokens.get(request.request_id, 0),
        "kv.blocks_allocated_gpu": kv.blocks_allocated_gpu,
        "kv.blocks_cached_gpu": kv.blocks_cached_gpu,
    }
    params = getattr(request, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", None)
    if isinstance(max_tokens, int):
        attrs["request.max_tokens"] = max_tokens
    if kv.effective_prompt_len is not None:
        attrs["request.effective_prompt_len"] = kv.effective_prompt_len
    return _with_offloads(attrs, kv)


def _event_limit() -> int:
    try:
        limit = int(os.environ.get("OTEL_SPAN_EVENT_COUNT_LIMIT") or _DEFAULT_EVENT_LIMIT)
    except ValueError:
        limit = _DEFAULT_EVENT_LIMIT
    return max(1, min(limit, 4096))  # also bounds memory when the SDK limit is lifted


class StepTracer:
    """The ``scheduler_steps`` span(s) of one scheduler, and its two-stage step sampling."""

    def __init__(
        self,
        tracer: Tracer,
        sample_rate: float,
        rich_subsample_rate: float,
        step_sampler: Sampler = random_sampler,
        rich_sampler: Sampler = random_sampler,
        *,
        span_attributes: Mapping[str, Any] | None = None,
        max_events_per_span: int | None = None,
        max_span_age_s: float = DEFAULT_MAX_SPAN_AGE_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.tracer = tracer
        self.sample_rate = validate_rate("step_sample_rate", sample_rate)
        self.rich_subsample_rate = validate_rate("rich_subsample_rate", rich_subsample_rate)
        self.step_sampler = step_sampler
        self.rich_sampler = rich_sampler
        self.clock_ns = clock_ns
        self.max_events_per_span = max_events_per_span or _event_limit()
        self._max_age_ns = int(max_span_age_s * 1e9)
        self._span_attributes = dict(span_attributes or {})
        self._warned: set[str] = set()
        self._index = 0
        self._events = 0
        self._span_start_ns = 0
        self.span: Span | None = None
        self._open_span(previous=None)

    def on_schedule_end(self, scheduler: Any, output: Any, step_id: int, ts_start_ns: int) -> None:
        """Offer one scheduled step (``scheduler`` after ``schedule()`` built ``output``)."""
        rate = self.sample_rate
        if rate <= 0.0 or self.span is None:
            return
        try:
            if rate < 1.0 and not self.step_sampler(step_id, rate):
                return
            running = scheduler.running
            attrs = batch_summary_attributes(
                step_id=step_id,
                ts_start_ns=ts_start_ns,
                ts_end_ns=self.clock_ns(),
                running=running,
                num_waiting=scheduler.get_request_counts()[1],
                output=output,
                requests=scheduler.requests,
                kv=get_step_kv_summary(scheduler.kv_cache_manager.block_pool),
            )
            self._add_event(BATCH_SUMMARY_EVENT, attrs, summary=True)
            rich = self.rich_subsample_rate
            if rich <= 0.0 or not running or (rich < 1.0 and not self.rich_sampler(step_id, rich)):
                return
            manager = scheduler.kv_cache_manager
        except Exception as e:
            self._failed("batch summary", e)
            return
        for req in list(running):
            try:
                kv = get_per_request_kv_metrics(req, manager)
                self._add_event(
                    REQUEST_SNAPSHOT_EVENT,
                    request_snapshot_attributes(req, step_id=step_id, output=output, kv=kv),
                )
            except Exception as e:  # one request's failure does not skip the others
                self._failed("request snapshot", e)

    def close(self) -> None:
        """End the current span (engine shutdown); later steps are not traced."""
        span, self.span = self.span, None
        if span is not None:
            try:
                span.set_attribute(SPAN_LAST, True)
                span.end()
            except Exception as e:
                self._failed("span end", e)

    def _open_span(self, previous: Span | None) -> None:
        try:
            links = [Link(previous.get_span_context())] if previous is not None else None
            attrs = {**self._span_attributes, SPAN_INDEX: self._index}
            self.span = self.tracer.start_span(
                STEP_SPAN_NAME, context=Context(), kind=SpanKind.INTERNAL, attributes=attrs, links=links
            )
        except Exception as e:
            self.span = None
            self._failed("span start", e)
            log.warning("step tracing disabled: the scheduler_steps span cannot be created")
            return
        self._events = 0
        self._span_start_ns = self.clock_ns()

    def _add_event(self, name: str, attrs: Mapping[str, Any], summary: bool = False) -> None:
        span = self.span
        if span is None:
            return
        if self._events >= self.max_events_per_span or (
            summary and self.clock_ns() - self._span_start_ns >= self._max_age_ns
        ):
            self._index += 1
            self._open_span(previous=span)
            try:
                span.end()
            except Exception as e:
                self._failed("span end", e)
            if self.span is None:
                return
            span = self.span
        span.add_event(name, attrs)
        self._events += 1

    def _failed(self, what: str, e: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("step tracing: %s failed (tracing only, scheduling continues): %r", what, e)
        else:
            log.debug("step tracing: %s failed: %r", what, e)
