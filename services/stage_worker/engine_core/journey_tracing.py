"""Request journey tracing inside the engine (docs/engine-tracing.md).

Each sampled request gets one ``llm_core`` span (SpanKind.INTERNAL) in the EngineCore, from its
admission by the scheduler to vLLM freeing it, parented by the request's ``trace_headers`` (a root
span without them). Its events: ``journey.QUEUED`` → ``journey.SCHEDULED`` (``schedule.kind`` FIRST
or RESUME) → ``journey.FIRST_TOKEN`` → [``journey.PREEMPTED`` → ``journey.SCHEDULED`` ...] →
``journey.FINISHED``, each with ``ts.monotonic_ns`` (int ns) and ``ts.monotonic`` (float s) of one
``time.monotonic_ns()`` read, the scheduler step (``scheduler.step``) and the request's progress.

Sampling: one decision per request at admission, ``sampler(key, journey_sample_rate)``, ``key`` the
request's W3C trace id if it has one (every engine decides alike for a trace), else its request id.
Tracing failures are contained: logged (once per kind at warning, then debug), scheduling proceeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.stage_worker.engine_core.tracing_config import Sampler, random_sampler, validate_rate

log = logging.getLogger("vllm.omnirelay.journey_tracing")
"""Under ``vllm.``: vLLM's logging set-up prints it in the EngineCore, prefixed with the process."""

CORE_SPAN_NAME = "llm_core"
_PROPAGATOR = TraceContextTextMapPropagator()


def monotonic_pair(clock_ns: Callable[[], int] = time.monotonic_ns) -> tuple[float, int]:
    """(seconds, nanoseconds) of one monotonic clock read."""
    ns = clock_ns()
    return ns / 1e9, ns


def sampling_key(request_id: str, trace_headers: Mapping[str, str] | None) -> str:
    """The request's trace id (32 hex digits) if it carries a valid ``traceparent``, else its id."""
    if trace_headers:
        parts = str(trace_headers.get("traceparent", "")).split("-")
        if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
            return parts[1].lower()
    return request_id


def finish_status(request: Any) -> str:
    """``FINISHED_LENGTH_CAPPED`` → ``length_capped`` (``stopped``, ``aborted``, ``error``, ...)."""
    name = getattr(getattr(request, "status", None), "name", "") or "unknown"
    return name.removeprefix("FINISHED_").lower()


@dataclass(slots=True)
class _Journey:
    span: Span
    running: bool = False
    ever_scheduled: bool = False


class JourneyTracer:
    """Journey spans and events for the requests of one scheduler, whose hooks call the ``on_*``
    methods and :meth:`close` (engine shutdown). None of them raises."""

    def __init__(
        self,
        tracer: Tracer,
        sample_rate: float,
        sampler: Sampler = random_sampler,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.tracer = tracer
        self.sample_rate = validate_rate("journey_sample_rate", sample_rate)
        self.sampler = sampler
        self._clock_ns = clock_ns
        self.sampled: dict[str, _Journey] = {}
        """Request id → journey of every sampled request not yet finished."""
        self.awaiting_first_token: set[str] = set()
        self._warned: set[str] = set()

    def on_request_added(self, request: Any, step: int) -> None:
        """A new request entered the scheduler: decide sampling; if sampled, start its span and
        emit QUEUED."""
        rate = self.sample_rate
        if rate <= 0.0:
            return
        rid = request.request_id
        try:
            headers = request.trace_headers
            if rate < 1.0 and not self.sampler(sampling_key(rid, headers), rate):
                return
            parent = _PROPAGATOR.extract(dict(headers)) if headers else Context()
            attrs: dict[str, Any] = {"gen_ai.request.id": rid, "journey.sample_rate": rate}
            max_tokens = getattr(request, "max_tokens", None)
            if isinstance(max_tokens, int):
                attrs["gen_ai.request.max_tokens"] = max_tokens
            span = self.tracer.start_span(
                CORE_SPAN_NAME, context=parent, kind=SpanKind.INTERNAL, attributes=attrs
            )
        except Exception as e:
            self._failed("sampling/span start", e)
            return
        self.sampled[rid] = _Journey(span)
        self.awaiting_first_token.add(rid)
        self._emit(self.sampled[rid], request, "QUEUED", step, phase="WAITING")

    def on_scheduled(self, output: Any, step: int, requests: Mapping[str, Any]) -> None:
        """End of ``schedule()``: PREEMPTED for sampled requests preempted since the last step,
        then SCHEDULED for sampled requests that (re)entered the running batch."""
        if not self.sampled:
            return
        try:
            preempted = output.preempted_req_ids
            if preempted:
                for rid in preempted:
                    j = self.sampled.get(rid)
                    if j is not None and (req := requests.get(rid)) is not None:
                        j.running = False
                        self._emit(j, req, "PREEMPTED", step, phase="WAITING")
            for rid in _entered_ids(output):
                j = self.sampled.get(rid)
                if j is None or j.running or (req := requests.get(rid)) is None:
                    continue
                kind = "RESUME" if j.ever_scheduled else "FIRST"
                j.running = j.ever_scheduled = True
                # num_computed_tokens already counts this step's tokens: report the progress the
                # request had when it was picked.
                done = req.num_computed_tokens - output.num_scheduled_tokens.get(rid, 0)
                self._emit(j, req, "SCHEDULED", step, schedule_kind=kind, computed=done)
        except Exception as e:
            self._failed("schedule hook", e)

    def on_outputs(self, scheduler_output: Any, step: int, requests: Mapping[str, Any]) -> None:
        """End of ``update_from_output()``: FIRST_TOKEN for sampled requests whose first output
        token arrived with this step's output (``step``: the step that produced it)."""
        awaiting = self.awaiting_first_token
        if not awaiting:
            return
        try:
            scheduled = scheduler_output.num_scheduled_tokens
            candidates = (
                [r for r in awaiting if r in scheduled]
                if len(awaiting) <= len(scheduled)
                else [r for r in scheduled if r in awaiting]
            )
            for rid in candidates:
                req = requests.get(rid)
                j = self.sampled.get(rid)
                if req is not None and j is not None and req.num_output_tokens > 0:
                    awaiting.discard(rid)
                    self._emit(j, req, "FIRST_TOKEN", step)
        except Exception as e:
            self._failed("output hook", e)

    def on_finished(self, request: Any, step: int) -> None:
        """vLLM frees a finished request: FINISHED (after FIRST_TOKEN if its first token came
        with the finishing output), end the span, forget the request."""
        rid = request.request_id
        j = self.sampled.pop(rid, None)
        if j is None:
            return
        try:
            if rid in self.awaiting_first_token:
                self.awaiting_first_token.discard(rid)
                if request.num_output_tokens > 0:
                    self._emit(j, request, "FIRST_TOKEN", step)
            status = finish_status(request)
            self._emit(j, request, "FINISHED", step, phase="FINISHED", status=status)
            j.span.set_attributes(
                {
                    "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
                    "gen_ai.usage.completion_tokens": request.num_output_tokens,
                    "finish.status": status,
                    "num_preemptions": request.num_preemptions,
                }
            )
        except Exception as e:
            self._failed("finish hook", e)
        finally:
            self._end(j)

    def close(self) -> None:
        """Engine shutdown: end the spans of requests still in the engine (``journey.incomplete``)."""
        journeys, self.sampled = self.sampled, {}
        self.awaiting_first_token.clear()
        for j in journeys.values():
            try:
                j.span.set_attribute("journey.incomplete", True)
            except Exception as e:
                self._failed("close", e)
            self._end(j)

    def _emit(
        self,
        j: _Journey,
        req: Any,
        kind: str,
        step: int,
        *,
        phase: str | None = None,
        schedule_kind: str | None = None,
        status: str | None = None,
        computed: int | None = None,
    ) -> None:
        """Add event ``journey.<kind>`` to ``j``'s span."""
        try:
            ts, ts_ns = monotonic_pair(self._clock_ns)
            prompt, outputs = req.num_prompt_tokens, req.num_output_tokens
            if computed is None:
                computed = req.num_computed_tokens
            attrs: dict[str, str | int | float] = {
                "ts.monotonic": ts,
                "ts.monotonic_ns": ts_ns,
                "scheduler.step": step,
                "phase": phase or ("PREFILL" if outputs == 0 else "DECODE"),
                "prefill.done_tokens": max(min(computed, prompt), 0),
                "prefill.total_tokens": prompt,
                "decode.done_tokens": outputs,
                "decode.max_tokens": req.max_tokens,
                "num_preemptions": req.num_preemptions,
            }
            if schedule_kind is not None:
                attrs["schedule.kind"] = schedule_kind
            if status is not None:
                attrs["finish.status"] = status
            j.span.add_event("journey." + kind, attrs)
        except Exception as e:
            self._failed(f"{kind} event", e)

    def _end(self, j: _Journey) -> None:
        try:
            j.span.end()
        except Exception as e:
            self._failed("span end", e)

    def _failed(self, what: str, e: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("journey tracing: %s failed (tracing only, scheduling continues): %r", what, e)
        else:
            log.debug("journey tracing: %s failed: %r", what, e)


def _entered_ids(output: Any) -> Iterable[str]:
    """Ids of requests that entered the running batch in this step (new or resumed)."""
    for new in output.scheduled_new_reqs:
        yield new.req_id
    yield from output.scheduled_cached_reqs.resumed_req_ids
