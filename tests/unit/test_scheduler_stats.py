"""The 1 Hz SchedulerStats throttle folds suppressed steps instead of dropping them.

Hand-built ``SchedulerStats`` sequences, a fake clock, no engine.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")

from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.stats import KVCacheEvictionEvent, PrefixCacheStats, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from services.stage_worker.engine_core.scheduler import (
    DELTA_FIELDS,
    LEVEL_FIELDS,
    SchedulerStatsThrottle,
    fold,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeConnectorStats:
    """Shaped like vLLM's KVConnectorStats: ``aggregate`` mutates and returns self."""

    data: dict[str, list[int]] = field(default_factory=lambda: {"xfer": []})

    def aggregate(self, other: FakeConnectorStats) -> FakeConnectorStats:
        self.data["xfer"].extend(other.data["xfer"])
        return self

    def to_dict(self) -> dict[str, list[int]]:
        return self.data


def step(
    k: int,
    running: int = 2,
    waiting: int = 1,
    *,
    spec: bool = True,
    connector: bool = True,
    perf: bool = True,
) -> SchedulerStats:
    """A busy step whose counters all depend on ``k``."""
    pcs = PrefixCacheStats()
    pcs.record(num_tokens=10 * k + 3, num_hits=k, preempted=False)
    pcs.record(num_tokens=5, num_hits=1, preempted=True)
    cpcs = None
    if connector:
        cpcs = PrefixCacheStats()
        cpcs.record(num_tokens=7 + k, num_hits=2, preempted=False, hits_by_source={CacheHitSource.HOST: 2})
    sds = None
    if spec:
        sds = SpecDecodingStats.new(2)
        sds.observe_draft(num_draft_tokens=2, num_accepted_tokens=k % 3)
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=0,
        num_kv_fetch_reqs_by_stage={"in_progress": k},
        step_counter=k,
        kv_cache_usage=0.01 * k,
        prefix_cache_stats=pcs,
        connector_prefix_cache_stats=cpcs,
        kv_cache_eviction_events=[KVCacheEvictionEvent(1.0 * k, 0.5, (0.1,))],
        spec_decoding_stats=sds,
        perf_stats=PerfStats(
            num_flops_per_gpu=100 * k, num_read_bytes_per_gpu=k, num_write_bytes_per_gpu=2 * k
        )
        if perf
        else None,
    )


def totals(stats: list[SchedulerStats]) -> dict[str, object]:
    """Every counter-like quantity summed over ``stats``."""
    out: dict[str, object] = {
        "queries": sum(s.prefix_cache_stats.queries for s in stats),
        "hits": sum(s.prefix_cache_stats.hits for s in stats),
        "requests": sum(s.prefix_cache_stats.requests for s in stats),
        "preempted_queries": sum(s.prefix_cache_stats.preempted_queries for s in stats),
        "preempted_hits": sum(s.prefix_cache_stats.preempted_hits for s in stats),
        "preempted_requests": sum(s.prefix_cache_stats.preempted_requests for s in stats),
        "conn_queries": sum(
            s.connector_prefix_cache_stats.queries for s in stats if s.connector_prefix_cache_stats
        ),
        "conn_hits": sum(
            s.connector_prefix_cache_stats.hits for s in stats if s.connector_prefix_cache_stats
        ),
        "conn_host_hits": sum(
            s.connector_prefix_cache_stats.hits_by_source.get(CacheHitSource.HOST, 0)
            for s in stats
            if s.connector_prefix_cache_stats
        ),
        "evictions": sum(len(s.kv_cache_eviction_events) for s in stats),
        "drafts": sum(s.spec_decoding_stats.num_drafts for s in stats if s.spec_decoding_stats),
        "draft_tokens": sum(s.spec_decoding_stats.num_draft_tokens for s in stats if s.spec_decoding_stats),
        "accepted": sum(s.spec_decoding_stats.num_accepted_tokens for s in stats if s.spec_decoding_stats),
        "accepted_pos": [
            sum(s.spec_decoding_stats.num_accepted_tokens_per_pos[i] for s in stats if s.spec_decoding_stats)
            for i in range(2)
        ],
        "flops": sum(s.perf_stats.num_flops_per_gpu for s in stats if s.perf_stats),
        "read": sum(s.perf_stats.num_read_bytes_per_gpu for s in stats if s.perf_stats),
        "write": sum(s.perf_stats.num_write_bytes_per_gpu for s in stats if s.perf_stats),
    }
    return out


def test_every_scheduler_stats_field_is_classified() -> None:
    """A field added by a newer vLLM must be classified (level or delta) before it is trusted."""
    names = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert LEVEL_FIELDS.isdisjoint(DELTA_FIELDS)
    assert names == LEVEL_FIELDS | DELTA_FIELDS


def test_first_step_is_emitted_then_a_burst_within_the_window_is_held() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    first = throttle.offer(step(1))
    assert first is not None and first.prefix_cache_stats.queries == 13
    for k in range(2, 12):
        clock.t += 0.05
        assert throttle.offer(step(k)) is None
    assert throttle.steps_folded == 10


def test_burst_emits_once_with_summed_counters_and_latest_levels() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    throttle.offer(step(0))  # opens the window
    burst = [step(k, running=k) for k in range(1, 21)]
    emitted = []
    for s in burst:
        clock.t += 0.04  # 20 steps in 0.8 s: all inside the window
        emitted.append(throttle.offer(s))
    assert emitted == [None] * 20
    clock.t += 0.25  # now 1.05 s after the first emission
    last = step(21, running=21)
    out = throttle.offer(last)
    assert out is not None
    assert totals([out]) == totals([*burst, last])
    # levels: the latest step's values
    assert out.num_running_reqs == 21
    assert out.step_counter == 21
    assert out.kv_cache_usage == pytest.approx(0.21)
    assert out.num_kv_fetch_reqs_by_stage == {"in_progress": 21}


def test_idle_step_is_emitted_immediately_with_pending_counts() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    throttle.offer(step(0))
    clock.t += 0.1
    assert throttle.offer(step(1)) is None
    clock.t += 0.1
    idle = step(2, running=0, waiting=0)
    out = throttle.offer(idle)
    assert out is not None, "an idle step must not wait for the window"
    assert out.num_running_reqs == 0 and out.num_waiting_reqs == 0
    assert totals([out]) == totals([step(1), idle])


def test_deferred_requests_are_not_idle() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    throttle.offer(step(0))
    clock.t += 0.1
    deferred = step(1, running=0, waiting=0)
    deferred.num_skipped_waiting_reqs = 1
    assert throttle.offer(deferred) is None


def test_a_second_window_starts_fresh() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    throttle.offer(step(0))
    for k in range(1, 5):
        clock.t += 0.1
        throttle.offer(step(k))
    clock.t += 0.7
    first = throttle.offer(step(5))
    assert first is not None
    # the next window: only what happened after the emission
    clock.t += 0.2
    assert throttle.offer(step(6)) is None
    clock.t += 0.9
    second = throttle.offer(step(7))
    assert second is not None
    assert totals([second]) == totals([step(6), step(7)])
    assert (
        second.kv_cache_eviction_events == step(6).kv_cache_eviction_events + step(7).kv_cache_eviction_events
    )


def test_nothing_is_lost_over_a_long_irregular_run() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    steps, emitted = [], []
    for k in range(500):
        clock.t += 0.003 + (k % 7) * 0.011  # irregular step times, ~20 s in all
        idle = k % 97 == 96
        s = step(
            k,
            running=0 if idle else 3,
            waiting=0 if idle else k % 2,
            spec=k % 3 != 0,
            connector=k % 4 != 0,
            perf=k % 5 != 0,
        )
        steps.append(s)
        if (out := throttle.offer(s)) is not None:
            emitted.append((clock.t, out))
    # flush: the engine goes idle at the end
    clock.t += 0.01
    last = step(500, running=0, waiting=0)
    steps.append(last)
    out = throttle.offer(last)
    assert out is not None
    emitted.append((clock.t, out))
    assert totals([e for _, e in emitted]) == totals(steps)
    # at most one emission per second, apart from idle snapshots
    busy = [t for t, e in emitted if e.num_running_reqs or e.num_waiting_reqs]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(busy))
    assert len(emitted) < len(steps) / 10


def test_offer_does_not_modify_the_steps() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    a, b = step(3), step(4)
    before = (dataclasses.asdict(a), dataclasses.asdict(b))
    throttle.offer(a)
    clock.t += 0.1
    throttle.offer(b)
    clock.t += 1.0
    throttle.offer(step(5))
    assert (dataclasses.asdict(a), dataclasses.asdict(b)) == before


def test_connector_stats_objects_are_aggregated_into_the_payload() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    throttle.offer(step(0), kv_connector_stats=FakeConnectorStats({"xfer": [0]}))
    held = [FakeConnectorStats({"xfer": [k]}) for k in (1, 2, 3)]
    for h in held:
        clock.t += 0.1
        assert throttle.offer(step(1), kv_connector_stats=h) is None
    clock.t += 0.1
    out = throttle.offer(step(2, running=0, waiting=0), ec_connector_stats=FakeConnectorStats({"xfer": [9]}))
    assert out is not None
    assert out.kv_connector_stats == {"xfer": [1, 2, 3]}
    assert out.ec_connector_stats == {"xfer": [9]}
    assert [h.data for h in held] == [{"xfer": [1]}, {"xfer": [2]}, {"xfer": [3]}], "inputs untouched"


def test_reset_flag_survives_folding() -> None:
    acc = SchedulerStats()
    fold(acc, step(1))
    reset = step(2)
    reset.prefix_cache_stats.reset = True
    fold(acc, reset)
    fold(acc, step(3))
    assert acc.prefix_cache_stats.reset
    assert acc.prefix_cache_stats.queries == 13 + 23 + 33


def idle_step(k: int = 0, *, counts: bool = False) -> SchedulerStats:
    s = SchedulerStats(num_running_reqs=0, num_waiting_reqs=0)
    if counts:
        s.prefix_cache_stats.record(num_tokens=k, num_hits=0, preempted=False)
    return s


def test_a_repeated_idle_snapshot_is_held_but_new_counts_are_not() -> None:
    """vLLM runs one more (empty) step after a request finishes: its idle snapshot would repeat
    the previous one, so it is held; an idle step that counted something still goes out."""
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    throttle.offer(step(0))
    clock.t += 0.1
    assert throttle.offer(idle_step()) is not None
    clock.t += 0.01
    assert throttle.offer(idle_step()) is None, "duplicate idle snapshot"
    clock.t += 0.01
    out = throttle.offer(idle_step(17, counts=True))
    assert out is not None and out.prefix_cache_stats.queries == 17
    clock.t += 0.01
    changed = idle_step()
    changed.kv_cache_usage = 0.25
    assert throttle.offer(changed) is not None, "a level changed"


def test_busy_then_idle_then_busy_emits_each_idle_transition_once() -> None:
    clock = Clock()
    throttle = SchedulerStatsThrottle(1.0, clock)
    emitted = 0
    for _ in range(10):  # ten short requests, one after the other, in 0.5 s
        for k in range(4):
            clock.t += 0.01
            emitted += throttle.offer(step(k)) is not None
        for _ in range(2):
            clock.t += 0.0025
            emitted += throttle.offer(idle_step()) is not None
    assert emitted == 1 + 10
