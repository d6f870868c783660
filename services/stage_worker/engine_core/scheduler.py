"""The scheduler of every ``llm`` worker's engine, and its 1 Hz ``SchedulerStats`` throttle.

vLLM loads :class:`OmniScheduler` inside the EngineCore process through
``AsyncEngineArgs(scheduler_cls=OMNI_SCHEDULER_CLS)``. It subclasses ``AsyncScheduler`` (a plain
``Scheduler`` subclass turns async scheduling off) and, with stats on, hands the frontend at most one
``SchedulerStats`` per :data:`STATS_INTERVAL_S`. :class:`SchedulerStatsThrottle` folds the suppressed
steps instead of dropping them: per-step deltas are summed, so vLLM's counters end where an
unthrottled engine puts them; levels take the latest step's value; a step that leaves the engine idle
goes out at once unless it would repeat the previous emission (docs/engine-metrics.md).

The scheduler also hosts the engine-side tracing (docs/engine-tracing.md): journey events
(:mod:`.journey_tracing`) and step tracing (:mod:`.step_tracing`), configured through
``VllmConfig.additional_config`` (:mod:`.tracing_config`). Without that configuration no tracing
object exists and every hook costs one ``is None`` check.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from itertools import zip_longest
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import Request

from services.stage_worker.engine_core import tracing_config
from services.stage_worker.engine_core.journey_tracing import JourneyTracer
from services.stage_worker.engine_core.step_tracing import StepTracer
from services.stage_worker.engine_core.tracing_config import EngineTracingConfig

logger = init_logger(__name__)
trace_log = init_logger("vllm.omnirelay.engine_tracing")
"""Engine tracing messages (under ``vllm.``, so vLLM's logging set-up prints them in the EngineCore)."""

OMNI_SCHEDULER_CLS = "services.stage_worker.engine_core.scheduler.OmniScheduler"
"""What ``AsyncEngineArgs.scheduler_cls`` names to load :class:`OmniScheduler`."""

STATS_INTERVAL_S = 1.0
"""At most one ``SchedulerStats`` per this many seconds per engine (idle snapshots excepted)."""

LEVEL_FIELDS = frozenset(
    {
        "num_running_reqs",
        "num_waiting_reqs",
        "num_skipped_waiting_reqs",
        "num_kv_fetch_reqs_by_stage",
        "step_counter",
        "current_wave",
        "kv_cache_usage",
        "iteration_details",
        "waiting_lora_adapters",
        "running_lora_adapters",
        "cudagraph_stats",
    }
)
"""``SchedulerStats`` fields that describe the engine *now*: the latest step's value wins.
(``cudagraph_stats`` is one sample per step for a logging table; it cannot be summed.)"""

DELTA_FIELDS = frozenset(
    {
        "prefix_cache_stats",
        "connector_prefix_cache_stats",
        "kv_cache_eviction_events",
        "spec_decoding_stats",
        "kv_connector_stats",
        "ec_connector_stats",
        "perf_stats",
    }
)
"""``SchedulerStats`` fields that count what happened *in the step*: summed over suppressed steps.
(``kv_connector_stats``/``ec_connector_stats`` are folded as connector objects, see
:meth:`SchedulerStatsThrottle.offer`.)"""

_SUMMED = ("prefix_cache_stats", "connector_prefix_cache_stats", "spec_decoding_stats", "perf_stats")


class SchedulerStatsThrottle:
    """Lets one ``SchedulerStats`` through per ``interval_s`` (seconds on ``clock``) and folds the
    steps in between: the first step, the first one ``interval_s`` after the last emission, and an
    idle step that tells something new are emitted, with everything folded since."""

    def __init__(self, interval_s: float = STATS_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._pending: SchedulerStats | None = None
        self._kv_connector_stats: Any = None
        self._ec_connector_stats: Any = None
        self._last_emit: float | None = None
        self._last_levels: tuple[Any, ...] | None = None
        self.steps_folded = 0
        """Steps offered since the last emission (including the emitting one)."""

    def offer(
        self,
        step: SchedulerStats,
        kv_connector_stats: Any = None,
        ec_connector_stats: Any = None,
    ) -> SchedulerStats | None:
        """Fold one step's stats in (``step`` is not modified); return what to send now, or
        ``None`` while throttled. The connector stats *objects* are aggregated and turned into the
        payload upstream sends (``to_dict()`` / ``.data``) on emission."""
        if self._pending is None:
            self._pending = SchedulerStats()
        fold(self._pending, step)
        self._kv_connector_stats = _add(self._kv_connector_stats, kv_connector_stats)
        self._ec_connector_stats = _add(self._ec_connector_stats, ec_connector_stats)
        self.steps_folded += 1

        now = self._clock()
        due = self._last_emit is None or now - self._last_emit >= self.interval_s
        if not due and not (is_idle(step) and self._idle_snapshot_is_news()):
            return None
        out = self._pending
        if self._kv_connector_stats is not None:
            out.kv_connector_stats = self._kv_connector_stats.to_dict()
        if self._ec_connector_stats is not None:
            out.ec_connector_stats = self._ec_connector_stats.data
        self._pending = None
        self._kv_connector_stats = self._ec_connector_stats = None
        self._last_emit = now
        self._last_levels = _levels(out)
        self.steps_folded = 0
        return out

    def _idle_snapshot_is_news(self) -> bool:
        """Whether an idle step must go out now: not if the last emission showed this idle state
        and nothing was counted since (vLLM's empty step after a request finishes)."""
        assert self._pending is not None
        return (
            self._last_levels != _levels(self._pending)
            or has_deltas(self._pending)
            or self._kv_connector_stats is not None
            or self._ec_connector_stats is not None
        )


def is_idle(stats: SchedulerStats) -> bool:
    """Nothing running and nothing waiting (deferred requests count as waiting)."""
    return not (stats.num_running_reqs or stats.num_waiting_reqs or stats.num_skipped_waiting_reqs)


def _levels(stats: SchedulerStats) -> tuple[Any, ...]:
    return (
        stats.num_running_reqs,
        stats.num_waiting_reqs,
        stats.num_skipped_waiting_reqs,
        sorted(stats.num_kv_fetch_reqs_by_stage.items()),
        stats.kv_cache_usage,
    )


def has_deltas(stats: SchedulerStats) -> bool:
    """Whether ``stats`` counts anything (a delta field is non-empty)."""
    caches = [stats.prefix_cache_stats, stats.connector_prefix_cache_stats]
    perf = stats.perf_stats
    return bool(
        any(
            c is not None and (c.reset or c.requests or c.queries or c.hits or c.preempted_requests)
            for c in caches
        )
        or stats.kv_cache_eviction_events
        or (stats.spec_decoding_stats is not None and stats.spec_decoding_stats.num_drafts)
        or stats.kv_connector_stats
        or stats.ec_connector_stats
        or (
            perf is not None
            and (perf.num_flops_per_gpu or perf.num_read_bytes_per_gpu or perf.num_write_bytes_per_gpu)
        )
    )


def fold(acc: SchedulerStats, step: SchedulerStats) -> None:
    """Fold ``step`` into ``acc`` (owned by the caller): levels replaced, deltas summed."""
    for f in fields(SchedulerStats):
        name = f.name
        new = getattr(step, name)
        if name in _SUMMED:
            setattr(acc, name, _add(getattr(acc, name), new))
        elif name == "kv_cache_eviction_events":
            acc.kv_cache_eviction_events.extend(new)
        elif new is not None or name in LEVEL_FIELDS:
            # Levels, and (defensively) connector payloads that arrive already serialised or
            # a field a newer vLLM added: the latest value wins.
            setattr(acc, name, copy.copy(new) if isinstance(new, dict) else new)


def _add(acc: Any, new: Any) -> Any:
    """``acc`` plus ``new``, vLLM's per-step counts (dataclasses of numbers, flags, per-key and
    per-position counts, or connector stats that ``aggregate()`` themselves); ``acc`` (ours) is
    changed in place, ``new`` never; None adds nothing."""
    if new is None:
        return acc
    if acc is None:
        return copy.deepcopy(new)
    if hasattr(new, "aggregate"):
        return acc.aggregate(new)
    if isinstance(new, bool):
        return acc or new
    if isinstance(new, dict):
        for k, v in new.items():
            acc[k] = acc.get(k, 0) + v
        return acc
    if isinstance(new, list):
        return [x + y for x, y in zip_longest(acc, new, fillvalue=0)]
    if not is_dataclass(new):
        return acc + new
    for f in fields(new):
        a, b = getattr(acc, f.name), getattr(new, f.name)
        setattr(acc, f.name, max(a, b) if f.name == "num_spec_tokens" else _add(a, b))
    return acc


class OmniScheduler(AsyncScheduler):
    """vLLM's async scheduler with the stats throttle and the engine-side tracing, whose hooks wrap
    vLLM's methods without changing what they return: ``add_request`` (QUEUED), ``schedule``
    (SCHEDULED, PREEMPTED, step events), ``update_from_output`` (FIRST_TOKEN), ``_free_request``
    (FINISHED, whatever the reason), ``has_requests`` (drained after SIGTERM/SIGINT: spans ended and
    flushed before the teardown) and ``shutdown``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stats_throttle: SchedulerStatsThrottle | None = None
        if self.log_stats:
            if self.observability_config.enable_logging_iteration_details:
                # EngineCore substitutes an empty SchedulerStats for a None on every step when
                # iteration details are logged; throttling would then zero the gauges.
                logger.warning("iteration-details logging is on: scheduler stats are not throttled")
            else:
                self._stats_throttle = SchedulerStatsThrottle()
        self.journey_tracer: JourneyTracer | None = None
        self.step_tracer: StepTracer | None = None
        self._trace_provider: Any = None
        self._output_steps: dict[int, int] = {}
        """id(SchedulerOutput) → its step (async scheduling updates step N after scheduling N + 1)."""
        self._output_step: int | None = None
        self._shutdown_signalled = False
        # Invalid settings raise here: the engine does not start (fail fast).
        cfg = EngineTracingConfig.from_vllm_config(self.vllm_config)
        if cfg is not None and cfg.active:
            self._start_tracing(cfg)
            if self._trace_provider is not None:
                self._watch_shutdown_signals()

    # -- tracing set-up ----------------------------------------------------------------------------

    def _start_tracing(self, cfg: EngineTracingConfig) -> None:
        try:
            provider = tracing_config.make_tracer_provider(cfg)
            tracer = provider.get_tracer(tracing_config.INSTRUMENTATION_SCOPE)
            journey_sampler, step_sampler, rich_sampler = cfg.samplers()
            journey = (
                JourneyTracer(tracer, cfg.journey_sample_rate, journey_sampler)
                if cfg.journey_enabled
                else None
            )
            steps = None
            if cfg.step_enabled:
                steps = StepTracer(
                    tracer,
                    cfg.step_sample_rate,
                    cfg.rich_subsample_rate,
                    step_sampler,
                    rich_sampler,
                    span_attributes={
                        "omnirelay.engine.pid": os.getpid(),
                        "omnirelay.tracing.journey_sample_rate": cfg.journey_sample_rate,
                        "omnirelay.tracing.step_enabled": cfg.step_enabled,
                        "omnirelay.tracing.step_sample_rate": cfg.step_sample_rate,
                        "omnirelay.tracing.rich_subsample_rate": cfg.rich_subsample_rate,
                        "omnirelay.tracing.sampler": cfg.sampler,
                    },
                )
        except Exception as e:  # tracing never prevents the engine from running
            trace_log.warning("engine tracing disabled: cannot set it up: %r", e)
            return
        self._trace_provider, self.journey_tracer, self.step_tracer = provider, journey, steps
        trace_log.info(
            "engine tracing on (pid %d): journey_sample_rate=%s step_tracing_enabled=%s "
            "step_sample_rate=%s rich_subsample_rate=%s sampler=%s -> %s (%s)",
            os.getpid(),
            cfg.journey_sample_rate,
            cfg.step_enabled,
            cfg.step_sample_rate,
            cfg.rich_subsample_rate,
            cfg.sampler,
            cfg.endpoint,
            cfg.protocol,
        )

    def _watch_shutdown_signals(self) -> None:
        """Note SIGTERM/SIGINT before passing them to the EngineCore's own handlers, so that
        :meth:`has_requests` ends and flushes the spans once drained, before the teardown (which may
        outlast the process manager's 5 s grace). Only Python handlers are wrapped, only on the main
        thread."""
        if threading.current_thread() is not threading.main_thread():
            return
        me = weakref.ref(self)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if not callable(previous) or previous is signal.default_int_handler:
                continue

            def noted(signum: int, frame: Any, _previous: Callable[..., Any] = previous) -> None:
                sched = me()
                if sched is not None:
                    sched._shutdown_signalled = True
                _previous(signum, frame)

            try:
                signal.signal(sig, noted)
            except (ValueError, OSError) as e:
                trace_log.debug("engine tracing: cannot watch signal %s: %r", sig, e)

    @property
    def _journey_sampled_requests(self) -> set[str]:
        """Ids of the sampled requests still in the engine."""
        return set(self.journey_tracer.sampled) if self.journey_tracer is not None else set()

    # -- hooks ---------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        journey = self.journey_tracer
        is_new = journey is not None and request.request_id not in self.requests
        super().add_request(request)
        if is_new and request.request_id in self.requests:
            journey.on_request_added(request, self.current_step)  # type: ignore[union-attr]

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        journey, steps = self.journey_tracer, self.step_tracer
        if journey is None and steps is None:
            return super().schedule(throttle_prefills)
        ts_start_ns = time.monotonic_ns()
        output = super().schedule(throttle_prefills)
        step = self.current_step
        if journey is not None and journey.sampled:
            journey.on_scheduled(output, step, self.requests)
            steps_of = self._output_steps
            steps_of[id(output)] = step
            while len(steps_of) > 64:  # outputs that never came back (bounded, defensive)
                del steps_of[next(iter(steps_of))]
        if steps is not None:
            steps.on_schedule_end(self, output, step, ts_start_ns)
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> Any:
        journey = self.journey_tracer
        if journey is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        step = self._output_steps.pop(id(scheduler_output), self.current_step)
        self._output_step = step
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._output_step = None
        journey.on_outputs(scheduler_output, step, self.requests)
        return outputs

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        journey = self.journey_tracer
        if journey is not None and journey.sampled:
            step = self._output_step if self._output_step is not None else self.current_step
            journey.on_finished(request, step)
        return super()._free_request(request, delay_free_blocks)

    def has_requests(self) -> bool:
        busy = super().has_requests()
        if not busy and self._shutdown_signalled and self._trace_provider is not None:
            # Drained after SIGTERM/SIGINT: the EngineCore tears down next.
            self._stop_tracing()
        return busy

    def shutdown(self) -> None:
        try:
            self._stop_tracing()
        finally:
            super().shutdown()

    def _stop_tracing(self) -> None:
        journey, steps, provider = self.journey_tracer, self.step_tracer, self._trace_provider
        self.journey_tracer = self.step_tracer = self._trace_provider = None
        try:
            if journey is not None:
                journey.close()
            if steps is not None:
                steps.close()
            if provider is not None:
                provider.force_flush(timeout_millis=3000)
                provider.shutdown()
        except Exception as e:
            trace_log.warning("engine tracing: shutdown failed: %r", e)

    # -- stats ---------------------------------------------------------------------------------------

    def make_stats(
        self,
        spec_decoding_stats=None,
        kv_connector_stats=None,
        cudagraph_stats=None,
        perf_stats=None,
        ec_connector_stats=None,
    ) -> SchedulerStats | None:
        throttle = self._stats_throttle
        if throttle is None:  # stats off (upstream returns None) or throttling disabled
            return super().make_stats(
                spec_decoding_stats,
                kv_connector_stats,
                cudagraph_stats,
                perf_stats,
                ec_connector_stats=ec_connector_stats,
            )
        # Always drain this step's counters (prefix cache, eviction samples, ...) from the
        # scheduler; the connector stats objects are folded by the throttle itself.
        step = super().make_stats(spec_decoding_stats, None, cudagraph_stats, perf_stats)
        if step is None:
            return None
        return throttle.offer(step, kv_connector_stats, ec_connector_stats)
