"""The orchestrator's liveness verdicts and the in-flight index it reads (pure parts)."""

from __future__ import annotations

from libs.common.envelopes import Liveness
from libs.common.records import RequestRecord, RequestStatus, StageProgress
from libs.common.registry import ServiceKind, ServiceRecord
from services.orchestrator.inflight import InflightRequests
from services.orchestrator.liveness import (
    PROBE_TIMEOUT_S,
    BrokerProof,
    Death,
    DeathReason,
    ProgressSeen,
    judgment_lifted,
    verdict,
)
from services.stage_worker.progress import HUNG_AFTER_STALLS, EngineProgress, HungEngineWatch


def test_no_responders_is_an_exit_at_once() -> None:
    assert verdict("no_responders", 0.0, 10.0, reconnecting=False) == DeathReason.EXIT


def test_silence_is_a_stall_only_after_the_stall_timeout() -> None:
    assert verdict("timeout", 9.9, 10.0, reconnecting=False) is None
    assert verdict("timeout", 10.0, 10.0, reconnecting=False) == DeathReason.STALL
    assert verdict("ok", 60.0, 10.0, reconnecting=False) is None


def test_after_a_reconnect_no_responders_is_no_exit_but_silence_still_stalls() -> None:
    """A broker restart: the worker may not have re-subscribed yet although it lives."""
    assert verdict("no_responders", 1.0, 10.0, reconnecting=True) is None
    assert verdict("no_responders", 10.0, 10.0, reconnecting=True) == DeathReason.STALL


def test_a_prompt_broker_leaves_a_replicas_silence_whole() -> None:
    proof = BrokerProof()
    for t in (1.0, 1.5, 2.0):  # round trips of 10 ms
        proof.sent(t)
        proof.done(t, t + 0.01, ok=True)
    assert proof.silent_s(since=0.5, now=3.0) == 2.5


def test_silence_counts_only_from_the_end_of_the_brokers_slow_time_plus_its_length() -> None:
    """The broker quiet from 10 to 16 s: a replica last heard at 9 s may spend as long again
    sending what it produced meanwhile, so it is silent from 22 s, not 9."""
    proof = BrokerProof()
    proof.sent(10.0)
    assert proof.silent_s(since=9.0, now=10.0 + PROBE_TIMEOUT_S / 2) == 1.0 + PROBE_TIMEOUT_S / 2
    assert proof.silent_s(since=9.0, now=10.0 + PROBE_TIMEOUT_S + 0.1) == 0.0  # the PONG is late
    assert proof.done(10.0, 16.0, ok=True)  # a slow time began
    assert proof.silent_s(since=9.0, now=17.0) == 0.0
    assert proof.silent_s(since=9.0, now=23.0) == 1.0
    assert proof.silent_s(since=16.5, now=17.0) == 0.5  # it answered after the slow time: as usual


def test_overlapping_slow_round_trips_are_one_slow_time() -> None:
    proof = BrokerProof()
    for t in (10.0, 10.5, 11.0):
        proof.sent(t)
    assert proof.done(10.5, 10.6, ok=False)  # a closed connection fails fast...
    assert not proof.done(10.0, 11.5, ok=False)  # ...an earlier round trip's timeout comes later
    assert not proof.done(11.0, 12.5, ok=True)  # slow: the same slow time, from 10 to 12.5 s
    assert proof.silent_s(since=9.0, now=16.0) == 1.0


def test_a_failed_round_trip_leaves_the_broker_unproven_until_it_ended() -> None:
    proof = BrokerProof()
    proof.sent(5.0)
    assert proof.done(5.0, 5.2, ok=False)  # a closed or reconnecting connection fails fast
    assert proof.silent_s(since=1.0, now=8.0) == 8.0 - 5.2 - 0.2


def _rec(rid: str, route: list[int], done: list[bool]) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        pipeline="p",
        gateway_id="g",
        status=RequestStatus.RUNNING,
        route=route,
        stages=[StageProgress(replica=r, done_ns=1 if d else None) for r, d in zip(route, done, strict=True)],
        arrival_ns=1,
        admitted_ns=1,
        deadline_ns=2,
        updated_ns=1,
    )


def test_bound_to_lists_requests_whose_stage_still_runs_on_the_replica() -> None:
    index = InflightRequests(kv=None, pipeline="p")  # type: ignore[arg-type]
    index.records = {
        "a": _rec("a", [1, 0], [False, False]),
        "b": _rec("b", [1, 0], [True, False]),  # stage 0 done on replica 1: not affected
        "c": _rec("c", [0, 0], [False, False]),
    }
    assert [r.request_id for r in index.bound_to(0, 1)] == ["a"]
    assert sorted(r.request_id for r in index.bound_to(1, 0)) == ["a", "b", "c"]
    assert index.busy() == {(0, 1), (0, 0), (1, 0)}
    index.forget("a")
    assert index.bound_to(0, 1) == []


def test_a_worker_whose_engine_died_is_dead_at_once_even_while_reconnecting() -> None:
    assert verdict("engine_dead", 0.0, 10.0, reconnecting=False) == DeathReason.ENGINE_DEAD
    assert verdict("engine_dead", 0.0, 10.0, reconnecting=True) == DeathReason.ENGINE_DEAD


def test_answers_with_flat_progress_and_work_under_way_are_a_stall_after_the_stall_timeout() -> None:
    assert verdict("ok", 0.0, 10.0, reconnecting=False, flat_s=9.9) is None
    assert verdict("ok", 0.0, 10.0, reconnecting=False, flat_s=10.0) == DeathReason.STALL


def test_progress_is_flat_only_while_the_counter_stands_and_work_is_under_way() -> None:
    seen = ProgressSeen(value=5, flat_since=0.0)
    assert seen.update(Liveness(busy=1, progress=5), 4.0) == 4.0
    assert seen.update(Liveness(busy=1, progress=6), 5.0) == 0.0  # an output: the clock restarts
    assert seen.update(Liveness(busy=1, progress=6), 7.5) == 2.5
    assert seen.update(Liveness(busy=0, progress=6), 8.0) == 0.0  # idle: nothing to make progress on
    assert seen.update(Liveness(busy=2, progress=6), 9.0) == 1.0


def test_against_a_cluster_no_responders_is_an_exit_only_once_it_lasted() -> None:
    """A worker whose NATS node died is reconnecting to another node meanwhile."""
    assert verdict("no_responders", 0.4, 10.0, reconnecting=False, exit_confirm_s=1.0) is None
    assert verdict("no_responders", 1.0, 10.0, reconnecting=False, exit_confirm_s=1.0) == DeathReason.EXIT


def test_engine_progress_counts_operations_under_way_however_they_end() -> None:
    p = EngineProgress()
    with p.working():
        assert p.busy == 1
        p.advanced()
        p.advanced()
    try:
        with p.working():
            raise RuntimeError("cancelled")
    except RuntimeError:
        pass
    assert (p.busy, p.outputs) == (0, 2)


def test_an_engine_is_hung_after_flat_outputs_with_work_for_two_stall_timeouts() -> None:
    p, watch = EngineProgress(busy=1, outputs=3), HungEngineWatch(stall_timeout_s=2.0, max_step_s=1.0)
    watch.observe(p, 0.5)  # outputs seen for the first time: the clock starts
    for _ in range(7):
        watch.observe(p, 0.5)
    assert watch.flat_s == 3.5 and not watch.hung
    p.busy = 0  # its requests were moved away after one stall timeout: the suspicion stays
    watch.observe(p, 0.5)
    assert watch.flat_s == HUNG_AFTER_STALLS * 2.0 and watch.hung


def test_an_idle_or_progressing_engine_is_not_hung_and_a_stopped_process_does_not_count() -> None:
    p, watch = EngineProgress(busy=0, outputs=3), HungEngineWatch(stall_timeout_s=2.0, max_step_s=1.0)
    for _ in range(21):
        watch.observe(p, 0.5)  # idle
    assert watch.flat_s == 0.0
    p.busy = 1
    watch.observe(p, 30.0)  # the whole process was stopped for 30 s: counted as one step
    assert watch.flat_s == 1.0
    p.busy = 0
    watch.observe(p, 0.5)  # short of one stall timeout: a slow step, not a hang
    assert watch.flat_s == 0.0
    p.busy, p.outputs = 1, 4
    watch.observe(p, 0.5)
    assert watch.flat_s == 0.0 and not watch.hung


def test_an_engine_whose_requests_were_moved_while_it_was_flat_stays_suspect_until_it_produces() -> None:
    """The orchestrators judged it stalled a little before this worker's own count reached the
    stall timeout; its requests left, so it has no work, but it still produced nothing."""
    p, watch = EngineProgress(busy=1, outputs=3), HungEngineWatch(stall_timeout_s=2.0, max_step_s=1.0)
    watch.observe(p, 0.5)
    for _ in range(3):
        watch.observe(p, 0.5)
    watch.moved_away()  # flat 1.5 s of 2: suspect
    p.busy = 0
    for _ in range(5):
        watch.observe(p, 0.5)
    assert watch.hung
    p.outputs = 4
    watch.observe(p, 0.5)
    assert not watch.hung and not watch.suspect


def test_a_move_away_from_an_engine_that_produces_is_no_suspicion() -> None:
    """A resync moves a request off a healthy replica (lost events): its engine was not flat."""
    p, watch = EngineProgress(busy=1, outputs=3), HungEngineWatch(stall_timeout_s=2.0, max_step_s=1.0)
    watch.observe(p, 0.5)
    watch.moved_away()
    p.busy = 0
    for _ in range(20):
        watch.observe(p, 0.5)
    assert watch.flat_s == 0.0 and not watch.hung


def _beat(started_ns: int, progress: int) -> ServiceRecord:
    return ServiceRecord(
        service=ServiceKind.WORKER,
        pipeline="p",
        instance="w",
        stage=0,
        replica=0,
        progress=progress,
        started_ns=started_ns,
    )


def test_an_engine_dead_replica_stays_judged_until_a_new_incarnation() -> None:
    """Its worker heartbeats on (with any progress) until it exits; only its successor is routable
    (a heartbeat between the verdict and a move once made the move pick the dead replica)."""
    dead = Death(0, 0, started_ns=100, reason=DeathReason.ENGINE_DEAD, silent_s=0.5)
    assert not judgment_lifted(dead, _beat(100, 7))
    assert not judgment_lifted(dead, _beat(100, 8))
    assert not judgment_lifted(dead, _beat(99, 9))
    assert judgment_lifted(dead, _beat(101, 0))


def test_a_hung_engine_is_lifted_only_by_more_progress_or_a_new_incarnation() -> None:
    hung = Death(0, 0, started_ns=100, reason=DeathReason.STALL, silent_s=10.0, progress=7)
    assert not judgment_lifted(hung, _beat(100, 7))
    assert not judgment_lifted(hung, _beat(100, 6)), "a heartbeat older than the verdict"
    assert judgment_lifted(hung, _beat(100, 8))
    assert judgment_lifted(hung, _beat(101, 0))


def test_a_silent_replica_is_lifted_by_any_heartbeat() -> None:
    silent = Death(0, 0, started_ns=100, reason=DeathReason.STALL, silent_s=10.0)
    assert judgment_lifted(silent, _beat(100, 7))
