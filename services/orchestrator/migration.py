"""Moving a request's stage off a dead replica to a live one as the stage's next *attempt*: the
decision, pure, on the record (:func:`plan_move` + :func:`apply_move`, applied by compare-and-set
so exactly one orchestrator moves it), and the input the dead replica had not acknowledged
(:func:`stored_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from libs.common import headers as h
from libs.common.records import RequestRecord, StageAttempt, StageProgress


class Phase(StrEnum):
    """Where the attempt that died was."""

    QUEUED = "queued"
    """Delivered to the replica (or waiting for it), not started by its engine yet."""
    IN_PROGRESS = "in_progress"


class NoMove(StrEnum):
    """Why a request bound to a dead replica is not moved."""

    ENDED = "ended"
    """The request is terminal, or its stage finished: nothing to move."""
    MOVED = "moved"
    """It no longer runs on that replica (another orchestrator moved it)."""
    LIMIT = "limit"
    """It has moved ``migration_limit`` times in this stage already: it fails."""


@dataclass(frozen=True)
class Move:
    """One request's stage moving from a dead replica to a live one, as attempt ``attempt``."""

    request_id: str
    stage: int
    from_replica: int
    to_replica: int
    attempt: int
    reason: str
    phase: Phase


def plan_move(
    rec: RequestRecord, stage: int, dead_replica: int, to_replica: int, reason: str, limit: int
) -> Move | NoMove:
    """What to do with ``rec``, bound to ``dead_replica`` of ``stage`` when it died: move it to
    ``to_replica`` as the stage's next attempt, or not (and why)."""
    progress = _running(rec, stage)
    if progress is None:
        return NoMove.ENDED
    if rec.route[stage] != dead_replica:
        return NoMove.MOVED
    if progress.attempt > limit:
        return NoMove.LIMIT
    phase = Phase.QUEUED if progress.started_ns is None else Phase.IN_PROGRESS
    return Move(rec.request_id, stage, dead_replica, to_replica, progress.attempt + 1, reason, phase)


def still_bound(rec: RequestRecord, stage: int, replica: int) -> bool:
    """Whether ``rec``'s ``stage`` still runs on ``replica``: neither the request nor the stage
    has ended, and the stage has not moved elsewhere (the in-memory index lags the bucket)."""
    return _running(rec, stage) is not None and rec.route[stage] == replica


def _running(rec: RequestRecord, stage: int) -> StageProgress | None:
    """``stage``'s progress, or None when the request is terminal or the stage has finished."""
    progress = rec.stages[stage] if stage < len(rec.stages) else None
    return None if rec.status.terminal or progress is None or progress.done_ns is not None else progress


def apply_move(rec: RequestRecord, move: Move, now_ns: int, claimed_by: str | None = None) -> None:
    """Bind ``rec``'s stage to the new replica and list the new attempt (the stage has not
    started there yet), carried out by orchestrator ``claimed_by``."""
    progress = rec.stages[move.stage]
    if not progress.attempts:  # a record written before attempts were listed
        progress.attempts.append(StageAttempt(attempt=1, replica=move.from_replica, bound_ns=rec.admitted_ns))
    progress.attempts.append(
        StageAttempt(
            attempt=move.attempt,
            replica=move.to_replica,
            bound_ns=now_ns,
            reason=move.reason,
            phase=move.phase.value,
            claimed_by=claimed_by,
        )
    )
    rec.route[move.stage] = move.to_replica
    progress.replica = move.to_replica
    progress.started_ns = None
    rec.updated_ns = max(rec.updated_ns, now_ns)


def unfinished_moves(rec: RequestRecord, live: set[str], now_ns: int, grace_ns: int) -> list[Move]:
    """The moves of ``rec`` claimed more than ``grace_ns`` ago (wall clock) by an orchestrator
    no longer among the ``live`` instances, whose input was never sent: each as the same move
    again (same attempt, same replicas), for another orchestrator to carry out."""
    if rec.status.terminal:
        return []
    found = []
    for s, progress in enumerate(rec.stages):
        if len(progress.attempts) < 2 or progress.done_ns is not None:
            continue
        last, before = progress.attempts[-1], progress.attempts[-2]
        if (
            last.claimed_by is not None
            and last.sent_ns is None
            and last.claimed_by not in live
            and now_ns - last.bound_ns > grace_ns
        ):
            phase = Phase(last.phase) if last.phase else Phase.QUEUED
            found.append(
                Move(rec.request_id, s, before.replica, last.replica, last.attempt, last.reason or "", phase)
            )
    return found


async def stored_inputs(
    js: JetStreamContext, stream: str, subject: str, request_id: str
) -> list[RawStreamMsg]:
    """The messages of ``request_id`` still stored (not acknowledged) on ``subject`` of work-queue
    ``stream``, oldest first; one request to the server per message on the subject."""
    found: list[RawStreamMsg] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return found
        if (msg.headers or {}).get(h.REQUEST_ID) == request_id:
            found.append(msg)
        seq = (msg.seq or seq) + 1
