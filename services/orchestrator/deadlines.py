"""Deadlines of requests nobody is working on any more: a request still not terminal ``GRACE_S``
after its deadline is marked failed, aborted everywhere and answered with a 504 (by exactly one
orchestrator: a compare-and-set on the record)."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

from libs.common.records import RequestRecord, RequestStatus
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.inflight import InflightRequests

log = logging.getLogger(__name__)

GRACE_S = 1.0
"""How long past its deadline a request may stay non-terminal before the sweeper acts, seconds."""
SWEEP_PERIOD_S = 0.5


async def sweep_deadlines(ctx: OrchestratorContext, inflight: InflightRequests) -> None:
    """Every ``SWEEP_PERIOD_S``, expire the requests of ``inflight`` past their deadline."""
    while True:
        await asyncio.sleep(SWEEP_PERIOD_S)
        limit = time.time_ns() - int(GRACE_S * 1e9)
        for rid in [r for r, rec in inflight.records.items() if rec.deadline_ns < limit]:
            try:
                await _expire(ctx, inflight, rid)
            except Exception as e:
                log.warning("request %s: deadline handling failed: %s", rid, e)


async def _expire(ctx: OrchestratorContext, inflight: InflightRequests, rid: str) -> None:
    try:
        entry = await ctx.requests.get(rid)
        rec = RequestRecord.model_validate_json(entry.value)
    except (NotFoundError, KeyError):
        rec = None
    if rec is None or rec.status.terminal:
        inflight.forget(rid)
        return
    rec.status, rec.error, rec.updated_ns = RequestStatus.FAILED, "timeout", time.time_ns()
    try:
        await ctx.requests.update(rid, rec.model_dump_json().encode(), last=entry.revision)
    except KeyWrongLastSequenceError:
        return  # another instance (or a worker's event) got there first; look again next sweep
    inflight.forget(rid)
    log.warning("request %s: past its deadline in status %s; failed and aborted", rid, rec.status)
    await ctx.end_everywhere(rec, 504, "timeout", "the request did not finish before its deadline")
