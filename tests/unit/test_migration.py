"""Moving a request off a dead replica, the pure parts: the decision on the record, the gateway's
fence and resume point, and how the record folds events of an attempt it has moved past."""

from __future__ import annotations

import time

import pytest

from cli.bus_inspect import _moves
from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    LifecycleEvent,
    ResumePoint,
    StageTask,
    TextDelta,
    Usage,
)
from libs.common.publish import task_msg_id
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from services.gateway.pipeline_client import RequestHandle
from services.orchestrator.lifecycle import apply_event
from services.orchestrator.migration import (
    Move,
    NoMove,
    Phase,
    apply_move,
    plan_move,
    still_bound,
    unfinished_moves,
)
from services.orchestrator.moves import _moved_task


def _rec(route: list[int], started: bool = False) -> RequestRecord:
    now = time.time_ns()
    return RequestRecord(
        request_id="r",
        pipeline="p",
        gateway_id="g",
        status=RequestStatus.RUNNING if started else RequestStatus.ADMITTED,
        route=route,
        stages=[
            StageProgress(
                replica=r,
                started_ns=now if started else None,
                attempts=[StageAttempt(attempt=1, replica=r, bound_ns=now)],
            )
            for r in route
        ],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + 10**10,
        updated_ns=now,
    )


def test_a_started_request_moves_in_progress_and_lists_its_new_attempt() -> None:
    rec = _rec([1, 0, 0], started=True)
    move = plan_move(rec, 0, dead_replica=1, to_replica=0, reason="exit", limit=3)
    assert move == Move("r", 0, 1, 0, 2, "exit", Phase.IN_PROGRESS)
    apply_move(rec, move, time.time_ns())
    assert rec.route == [0, 0, 0] and rec.stages[0].replica == 0
    assert rec.stages[0].attempt == 2 and rec.stages[0].started_ns is None
    assert [(a.attempt, a.replica, a.reason, a.phase) for a in rec.stages[0].attempts] == [
        (1, 1, None, None),
        (2, 0, "exit", "in_progress"),
    ]


def test_a_request_not_started_moves_queued() -> None:
    move = plan_move(_rec([1]), 0, 1, 0, "stall", 3)
    assert isinstance(move, Move) and move.phase == Phase.QUEUED and move.reason == "stall"


def test_no_move_for_a_request_that_ended_or_moved_already() -> None:
    done = _rec([1], started=True)
    done.status = RequestStatus.COMPLETED
    assert plan_move(done, 0, 1, 0, "exit", 3) == NoMove.ENDED
    stage_done = _rec([1, 0], started=True)
    stage_done.stages[0].done_ns = time.time_ns()
    assert plan_move(stage_done, 0, 1, 0, "exit", 3) == NoMove.ENDED
    assert plan_move(_rec([0]), 0, 1, 0, "exit", 3) == NoMove.MOVED


def test_a_request_handed_over_again_after_its_move_is_no_longer_bound_to_the_dead_replica() -> None:
    """The index lags the bucket: a verdict's later hand-over of a request that has moved, ended
    or finished the stage must not fail it (``no_live_replica`` is only for one still there)."""
    rec = _rec([1, 0], started=True)
    assert still_bound(rec, 0, 1) and not still_bound(rec, 0, 0) and still_bound(rec, 1, 0)
    apply_move(rec, plan_move(rec, 0, 1, 0, "stall", 3), time.time_ns())
    assert not still_bound(rec, 0, 1) and still_bound(rec, 0, 0)
    rec.stages[0].done_ns = time.time_ns()
    assert not still_bound(rec, 0, 0) and still_bound(rec, 1, 0)
    rec.status = RequestStatus.COMPLETED
    assert not still_bound(rec, 1, 0)


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_the_migration_limit_counts_moves_per_stage(limit: int) -> None:
    rec = _rec([0], started=True)
    for n in range(limit):
        move = plan_move(rec, 0, rec.route[0], 1 - rec.route[0], "exit", limit)
        assert isinstance(move, Move) and move.attempt == n + 2
        apply_move(rec, move, time.time_ns())
    assert plan_move(rec, 0, rec.route[0], 1 - rec.route[0], "exit", limit) == NoMove.LIMIT


def _text(attempt: int, ids: list[int], text: str, seq: int = 0) -> ClientEvent:
    return ClientEvent(
        request_id="r", type=ClientEventType.TEXT, stage=0, token_ids=ids, text=text, attempt=attempt, seq=seq
    )


def test_the_resume_point_is_what_the_client_got_and_older_attempts_are_fenced_off() -> None:
    handle = RequestHandle("r", time.time_ns() + 10**10)
    assert handle.put(_text(1, [5, 6], "ab", 0))
    assert handle.put(_text(1, [7], "c", 1))
    point = handle.resume_point(0, 2, text=True)
    assert point.known and not point.text_done
    assert point.deltas == [TextDelta(token_ids=[5, 6], text="ab"), TextDelta(token_ids=[7], text="c")]
    assert not handle.put(_text(1, [8], "d", 2)), "an event of the attempt that moved away got through"
    assert handle.put(_text(2, [8], "e", 0))
    done = ClientEvent(
        request_id="r",
        type=ClientEventType.TEXT_DONE,
        stage=0,
        attempt=2,
        seq=1,
        usage=Usage(prompt_tokens=1, completion_tokens=4),
    )
    assert handle.put(done)
    assert handle.resume_point(0, 3, text=True).text_done
    taken = [handle.queue.get_nowait() for _ in range(handle.queue.qsize())]
    assert [e.text for e in taken if e.type == ClientEventType.TEXT] == ["ab", "c", "e"]


def test_a_fence_of_one_stage_leaves_the_others_alone() -> None:
    handle = RequestHandle("r", time.time_ns() + 10**10)
    handle.resume_point(2, 2, text=False)
    audio = ClientEvent(request_id="r", type=ClientEventType.AUDIO, stage=2, attempt=1, pcm16=b"\0\0")
    assert not handle.put(audio)
    assert handle.put(_text(1, [1], "x"))


def _event(kind: str, attempt: int, **fields) -> LifecycleEvent:
    return LifecycleEvent(
        request_id="r", kind=kind, ts_ns=time.time_ns(), stage=0, replica=1, attempt=attempt, **fields
    )


def test_the_record_ignores_a_start_or_failure_of_an_attempt_it_moved_past() -> None:
    rec = _rec([1], started=True)
    apply_move(rec, plan_move(rec, 0, 1, 0, "stall", 3), time.time_ns())
    apply_event(rec, _event("started", 1))
    assert rec.stages[0].started_ns is None
    apply_event(rec, _event("failed", 1, reason="timeout"))
    assert rec.status == RequestStatus.RUNNING
    apply_event(rec, _event("started", 2))
    assert rec.stages[0].started_ns is not None
    apply_event(rec, _event("finished", 2, finish_reason="length"))
    assert rec.status == RequestStatus.COMPLETED


def test_a_moved_task_is_new_to_the_stream_and_so_is_a_chunk_of_a_later_sender_attempt() -> None:
    first = StageTask(
        request_id="r", gateway_id="g", arrival_ns=1, deadline_ns=2, route=[0], kind="start", seq=0
    )
    moved = first.replace(attempt=2)
    assert task_msg_id(first, 0) == "r.0.0" and task_msg_id(moved, 0) == "r.0.0.2"
    chunk = first.replace(kind="chunk", seq=3)
    assert task_msg_id(chunk, 1) == "r.1.3"
    # A chunk the same sender attempt sends again is a duplicate; a later sender attempt's chunk
    # of the same number is not (a stale sender that got its chunk in first must not block it).
    later = chunk.replace(from_attempt=2)
    assert task_msg_id(later, 1) == "r.1.3.f2"
    assert task_msg_id(later.replace(attempt=3), 1) == "r.1.3.3.f2"


def test_inspect_lists_each_move_of_a_request() -> None:
    rec = _rec([1, 0], started=True)
    apply_move(rec, plan_move(rec, 0, 1, 0, "exit", 3), time.time_ns())
    assert _moves(rec.model_dump(mode="json")) == "0:1→0"
    assert _moves(_rec([0]).model_dump(mode="json")) == "-"


def test_events_after_a_gap_wait_until_their_sender_sends_the_missing_one_again() -> None:
    """Events 0..1 arrive, 2 is lost (a broker restart), 3 and 4 arrive: they wait, and the
    sender's question is answered with 2; its copy of 2 lets all three through in order."""
    handle = RequestHandle("r", time.time_ns() + 10**10)
    _thinker_stream(handle, 1)
    assert handle.put(_text(1, [7], "c", 3)) and handle.put(_text(1, [8], "d", 4))
    assert handle.gaps == 1 and handle.received(0, 1) == ResumePoint(known=True, next_seq=2)
    assert handle.queue.qsize() == 2, "an event after the gap reached the client"
    assert handle.put(_text(1, [6], "b", 2))  # sent again
    assert not handle.put(_text(1, [7], "c", 3)), "an event taken twice"
    assert handle.received(0, 1).next_seq == 5
    got = [handle.queue.get_nowait() for _ in range(handle.queue.qsize())]
    assert [e.seq for e in got] == [0, 1, 2, 3, 4]


def test_the_worker_of_an_attempt_the_request_moved_past_is_told_its_events_are_not_taken() -> None:
    handle = RequestHandle("r", time.time_ns() + 10**10)
    _thinker_stream(handle, 1)
    assert handle.put(_text(1, [7], "c", 3))  # seq 2 lost; then the thinker died and the request moved
    assert handle.resume_point(0, 2, text=True).deltas == [TextDelta(token_ids=[0], text="x")]
    assert handle.received(0, 1) == ResumePoint(known=False)
    assert not handle.put(_text(1, [6], "b", 2)), "the old attempt still gets through"
    assert handle.received(0, 2) == ResumePoint(known=True, next_seq=0)
    assert handle.put(_text(2, [6], "b", 0))


def test_an_ending_event_a_later_attempt_sends_again_reaches_the_client_once() -> None:
    """A thinker dies after its ``text_done`` arrived and before its input was acknowledged: the
    attempt after the move finds the text complete and ends it again."""
    handle = RequestHandle("r", time.time_ns() + 10**10)
    _thinker_stream(handle, 1)
    done = ClientEvent(request_id="r", type=ClientEventType.TEXT_DONE, stage=0, seq=2, finish_reason="stop")
    assert handle.put(done)
    assert handle.resume_point(0, 2, text=True).text_done
    assert not handle.put(done.replace(attempt=2, seq=0, finish_reason="length"))
    assert [handle.queue.get_nowait().type for _ in range(handle.queue.qsize())][
        -1
    ] == ClientEventType.TEXT_DONE
    assert handle.queue.qsize() == 0


def _thinker_stream(handle: RequestHandle, deltas: int) -> None:
    assert handle.put(ClientEvent(request_id="r", type=ClientEventType.STARTED, stage=0, seq=0))
    for i in range(deltas):
        assert handle.put(_text(1, [i], "x", i + 1))


def test_a_move_claimed_by_a_gone_orchestrator_and_never_sent_is_found_again() -> None:
    rec = _rec([1, 0, 0], started=True)
    move = plan_move(rec, 0, dead_replica=1, to_replica=0, reason="exit", limit=3)
    claimed = time.time_ns()
    apply_move(rec, move, claimed, claimed_by="o1")
    grace = 2 * 10**9
    later = claimed + grace + 1
    assert unfinished_moves(rec, {"o1"}, later, grace) == []  # its claimer lives
    assert unfinished_moves(rec, set(), claimed + grace, grace) == []  # too soon
    assert unfinished_moves(rec, set(), later, grace) == [move]
    rec.stages[0].attempts[-1].sent_ns = later  # carried out
    assert unfinished_moves(rec, set(), later, grace) == []


def test_first_attempts_and_moves_without_a_claimer_are_never_taken_over() -> None:
    rec = _rec([1, 0, 0], started=True)
    assert unfinished_moves(rec, set(), time.time_ns() + 10**12, 0) == []
    apply_move(rec, plan_move(rec, 0, 1, 0, "stall", 3), time.time_ns())  # a record of before claims
    assert unfinished_moves(rec, set(), time.time_ns() + 10**12, 0) == []


def test_an_input_moved_to_a_new_attempt_is_marked_so_the_stage_0_fence_keeps_it() -> None:
    """A talker that died after the thinker moved may hold a chunk of the old thinker attempt that
    it had taken (and dropped the newer copy as a repeat): moved on, that chunk is the only one of
    its number, and the new talker must not drop it as stale."""
    rec = _rec([0, 1, 0], started=True)
    chunk = StageTask(
        request_id="r", gateway_id="g", arrival_ns=1, deadline_ns=2, route=[0, 1, 0], kind="chunk", seq=3
    )
    move = Move("r", 1, 1, 0, 2, "exit", Phase.IN_PROGRESS)
    moved = _moved_task(chunk, move, 3, ResumePoint(known=True), rec)
    assert (moved.moved, moved.attempt, moved.from_attempt, moved.route) == (True, 2, 1, [0, 0, 0])
    assert not chunk.moved
