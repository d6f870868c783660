"""What a request's record says about an input a worker is about to start.

A worker learns of moves from notices on core NATS (an abort notice fences an older attempt off,
a move's route notices re-point the chunks it sends downstream). A notice can miss it: the worker was
started after it (a replacement that takes over a dead replica's durable consumer and gets its
unacknowledged inputs), or the request's input still waited in the stream when the orchestrator
asked this worker to hold the request's chunks (the worker did not hold it yet, so it answered
"not held", and the orchestrator moved the next stage with nothing to re-send). The record in
the ``omni_requests`` bucket is written before any notice is sent, so a worker that reads it when
it starts a request here catches up: it drops an input of an attempt its stage has moved past, and
sends its chunks to the next stage's current attempt. The worker reads it beside the request's
handler (``Worker._check_record``): the engine starts at once, and nothing of the request leaves
the worker until the verdict (``RequestContext.await_clearance``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from libs.common.envelopes import StageTask
from libs.common.records import RequestRecord

log = logging.getLogger(__name__)

STALE_START = "stale_start"
"""Why a request whose start the record refused was stopped (``RequestContext.refuse``)."""


@dataclass(frozen=True)
class Downstream:
    """The next stage's current attempt, as the record has it: where this worker's chunks go."""

    stage: int
    replica: int
    attempt: int
    start_seq: int


@dataclass(frozen=True)
class StartVerdict:
    drop: str | None = None
    """Why the input is not to be started here (None: start it)."""
    downstream: Downstream | None = None
    """The next stage moved after the input was written: send its chunks here instead."""


def judge_start(rec: RequestRecord, stage: int, task: StageTask) -> StartVerdict:
    """The verdict on starting ``task`` (the first input of its request at this worker of ``stage``)
    given the request's record ``rec``."""
    # A terminal status is no reason to drop: an older attempt's end can complete the record
    # while the newer one, which the client waits for, has yet to start (a move to the same
    # replica: the old attempt winds down first; services/orchestrator/lifecycle.py).
    if stage < len(rec.stages) and rec.stages[stage].attempt > task.attempt:
        return StartVerdict(
            drop=f"attempt {task.attempt} is stale: the stage moved to attempt {rec.stages[stage].attempt}"
        )
    nxt = stage + 1
    if nxt >= len(rec.stages) or nxt >= len(rec.route) or rec.stages[nxt].attempt <= task.next_attempt:
        return StartVerdict()
    last = rec.stages[nxt].attempts[-1]
    # While the move is under way (its input not sent yet) nothing of this request has gone to the
    # new attempt: this worker has sent nothing for it yet, so the new attempt takes chunks from 0.
    start_seq = last.start_seq if last.sent_ns is not None else 0
    return StartVerdict(downstream=Downstream(nxt, rec.route[nxt], last.attempt, start_seq))


async def read_verdict(records: KeyValue | None, stage: int, task: StageTask) -> StartVerdict:
    """:func:`judge_start` on the record as stored now; start as the input says when there is no
    record to read (none yet, or the bucket does not answer: the notices still apply)."""
    if records is None:
        return StartVerdict()
    try:
        entry = await records.get(task.request_id)
    except KeyNotFoundError:
        return StartVerdict()
    except Exception as e:  # the broker is away: the input's own word stands
        log.info(
            "request %s: its record could not be read (%s); started as its input says", task.request_id, e
        )
        return StartVerdict()
    if entry.value is None:
        return StartVerdict()
    try:
        rec = RequestRecord.model_validate_json(entry.value)
    except ValidationError:  # not a record (written by no service of ours: the bus fuzzer does)
        log.warning(
            "request %s: its record is not a request record; started as its input says", task.request_id
        )
        return StartVerdict()
    return judge_start(rec, stage, task)
