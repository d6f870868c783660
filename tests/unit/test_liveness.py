"""The orchestrator's liveness verdicts and the in-flight index it reads (pure parts)."""

from __future__ import annotations

from libs.common.records import RequestRecord, RequestStatus, StageProgress
from services.orchestrator.inflight import InflightRequests
from services.orchestrator.liveness import DeathReason, verdict


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
