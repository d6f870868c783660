"""A worker that starts a request reads its record and catches up on the moves whose notices it
missed (services/stage_worker/record_check.py): the decisions, on records the orchestrator's own
move functions produced."""

from __future__ import annotations

import time

from libs.common.envelopes import StageTask, TaskKind
from libs.common.records import RequestRecord, RequestStatus
from services.orchestrator.migration import apply_move, plan_move
from services.stage_worker.record_check import Downstream, StartVerdict, judge_start
from tests.records import bound_record


def _rec(route: list[int]) -> RequestRecord:
    return bound_record("r", route, status=RequestStatus.RUNNING, deadline_s=10)


def _chunk(route: list[int], attempt: int = 1, next_attempt: int = 1) -> StageTask:
    return StageTask(
        request_id="r",
        gateway_id="g",
        arrival_ns=0,
        deadline_ns=0,
        route=route,
        kind=TaskKind.CHUNK,
        seq=0,
        attempt=attempt,
        next_attempt=next_attempt,
    )


def _moved(rec: RequestRecord, stage: int, to: int, sent_start: int | None) -> None:
    move = plan_move(rec, stage, dead_replica=rec.route[stage], to_replica=to, reason="exit", limit=3)
    apply_move(rec, move, time.time_ns())
    if sent_start is not None:  # the move's input went out (services/orchestrator/moves.py notes it)
        rec.stages[stage].attempts[-1].start_seq = sent_start
        rec.stages[stage].attempts[-1].sent_ns = time.time_ns()


def test_an_input_the_record_agrees_with_is_started_as_it_says() -> None:
    assert judge_start(_rec([0, 1, 0]), 1, _chunk([0, 1, 0])) == StartVerdict()


def test_the_next_stage_moved_while_the_input_waited_in_the_stream() -> None:
    """The incident of the chaos soak: code2wav-0 died while the talker's input still waited in
    the stream; the move found nothing to re-send, and the talker, started later, sent all its
    chunks to the dead replica's successor as attempt 1."""
    rec = _rec([0, 1, 0])
    _moved(rec, 2, to=1, sent_start=0)
    verdict = judge_start(rec, 1, _chunk([0, 1, 0]))
    assert verdict == StartVerdict(downstream=Downstream(stage=2, replica=1, attempt=2, start_seq=0))
    _moved(rec, 2, to=0, sent_start=7)  # and moved again: the latest attempt, its start
    assert judge_start(rec, 1, _chunk([0, 1, 0])).downstream == Downstream(2, 0, 3, 7)


def test_a_move_still_under_way_takes_this_workers_chunks_from_the_first() -> None:
    rec = _rec([0, 1, 0])
    _moved(rec, 2, to=1, sent_start=None)
    assert judge_start(rec, 1, _chunk([0, 1, 0])).downstream == Downstream(2, 1, 2, 0)


def test_an_input_that_already_names_the_next_stages_attempt_is_not_redirected() -> None:
    rec = _rec([0, 1, 0])
    _moved(rec, 2, to=1, sent_start=0)
    assert judge_start(rec, 1, _chunk([0, 1, 1], next_attempt=2)) == StartVerdict()


def test_an_input_of_an_attempt_the_stage_moved_past_is_dropped() -> None:
    """A replacement worker takes over the dead replica's durable consumer and gets the inputs it
    had not acknowledged: the stage has moved on to another replica meanwhile."""
    rec = _rec([0, 1, 0])
    _moved(rec, 2, to=1, sent_start=0)
    verdict = judge_start(rec, 2, _chunk([0, 1, 0], attempt=1))
    assert verdict.drop == "attempt 1 is stale: the stage moved to attempt 2"
    assert judge_start(rec, 2, _chunk([0, 1, 1], attempt=2)) == StartVerdict()


def test_an_ended_record_does_not_drop_the_current_attempts_input() -> None:
    """A resync to the same replica: the old attempt winds down first and its end can complete the
    record before the new attempt starts; the client waits for the new attempt's events."""
    rec = _rec([0])
    _moved(rec, 0, to=0, sent_start=0)
    rec.status = RequestStatus.COMPLETED
    assert judge_start(rec, 0, _chunk([0], attempt=2)) == StartVerdict()
    assert judge_start(rec, 0, _chunk([0], attempt=1)).drop is not None
