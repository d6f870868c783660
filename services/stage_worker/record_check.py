"""What a request's record says about an input a worker is about to start: the record is written
before any notice of a move is sent, so a worker that missed a notice catches up when it starts the
request (drops an input of an attempt its stage has moved past, re-points its chunks).
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
"""Why a request whose start the record refused was stopped."""


@dataclass(frozen=True)
class Downstream:
    """The next stage's current attempt, as the record has it."""

    stage: int
    replica: int
    attempt: int
    start_seq: int


@dataclass(frozen=True)
class StartVerdict:
    drop: str | None = None
    """Why the input is not to be started here (None: start it)."""
    downstream: Downstream | None = None
    """Where its chunks go instead (the next stage moved after the input was written)."""


def judge_start(rec: RequestRecord, stage: int, task: StageTask) -> StartVerdict:
    """The verdict on starting ``task`` at this worker of ``stage``, given the record ``rec``."""
    # A terminal status is no reason to drop: an older attempt's end can complete the record
    # while the newer one, which the client waits for, has yet to start.
    if stage < len(rec.stages) and rec.stages[stage].attempt > task.attempt:
        return StartVerdict(
            drop=f"attempt {task.attempt} is stale: the stage moved to attempt {rec.stages[stage].attempt}"
        )
    nxt = stage + 1
    if nxt >= len(rec.stages) or nxt >= len(rec.route) or rec.stages[nxt].attempt <= task.next_attempt:
        return StartVerdict()
    last = rec.stages[nxt].attempts[-1]
    # While the move is under way nothing has gone to the new attempt: it takes chunks from 0.
    start_seq = last.start_seq if last.sent_ns is not None else 0
    return StartVerdict(downstream=Downstream(nxt, rec.route[nxt], last.attempt, start_seq))


async def read_verdict(records: KeyValue | None, stage: int, task: StageTask) -> StartVerdict:
    """:func:`judge_start` on the stored record; start as the input says without one."""
    if records is None:
        return StartVerdict()
    rid, rec = task.request_id, None
    try:
        entry = await records.get(rid)
        rec = None if entry.value is None else RequestRecord.model_validate_json(entry.value)
    except KeyNotFoundError:
        pass
    except ValidationError:  # not a record (the bus fuzzer writes such)
        log.warning("request %s: its record is not a request record; started as its input says", rid)
    except Exception as e:  # the broker is away: the input's own word stands
        log.info("request %s: its record could not be read (%s); started as its input says", rid, e)
    return StartVerdict() if rec is None else judge_start(rec, stage, task)
