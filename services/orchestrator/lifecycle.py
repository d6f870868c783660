"""The lifecycle: the stages' lifecycle events (``omni.<p>.events.*``) folded into the request's
record, and the summary of a request that has ended."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from libs.common.envelopes import LifecycleEvent, decode
from libs.common.record_updates import update_record
from libs.common.records import RequestRecord, RequestStatus
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.summary import PipelineTally, format_summary, ready_to_summarize

log = logging.getLogger(__name__)

UNKNOWN_EVENT_TRIES = 3
"""Deliveries of a lifecycle event whose request has no record before it is dropped."""
UNKNOWN_EVENT_RETRY_S = 0.2
"""Redelivery delay of such an event, seconds."""
EVENT_DEFER_S = 0.01
"""A lifecycle event waits this long before its record update, seconds: bookkeeping then runs
beside the engine's work instead of beside the next request's admission and dispatch."""
MAX_CONCURRENT_EVENTS = 16
"""Lifecycle events one orchestrator works on at once (updates of one record are compare-and-set)."""


async def on_event(ctx: OrchestratorContext, log_stats: bool, tally: PipelineTally, msg: Msg) -> None:
    """Fold one lifecycle event from the events consumer into its request's record; with
    ``log_stats``, log the summary of a request that has ended and count it in ``tally``."""
    ev = decode(LifecycleEvent, msg.data)
    await asyncio.sleep(EVENT_DEFER_S)
    summary: list[RequestRecord] = []

    def change(rec: RequestRecord) -> bool:
        if not apply_event(rec, ev):
            return False  # folded before
        if log_stats and ready_to_summarize(rec):
            rec.summary_logged = True
            summary[:] = [rec]
        return True

    if not await update_record(ctx.requests, ev.request_id, change):
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        if attempt < UNKNOWN_EVENT_TRIES:  # its admission may still be writing the record
            await msg.nak(delay=UNKNOWN_EVENT_RETRY_S)
            return
        log.warning("event %s of request %s dropped: the request has no record", ev.kind, ev.request_id)
    await msg.ack()
    for rec in summary:  # only the writer whose update stuck gets here
        log.info("%s", format_summary(rec, ctx.pipeline))
        tally.end(rec)


def apply_event(rec: RequestRecord, ev: LifecycleEvent) -> bool:
    """Fold a lifecycle event into a record; False when it was folded in before (a redelivery).
    A terminal status is final (late events only fill in timestamps); an attempt the stage has
    moved past neither starts nor fails it, but its ending events still count."""
    key = f"{ev.kind}.{ev.stage}.{ev.attempt}"
    if key in rec.events:
        return False
    rec.events.append(key)
    s = ev.stage
    stage = rec.stages[s] if s is not None and 0 <= s < len(rec.stages) else None
    if stage is not None and ev.attempt < stage.attempt and ev.kind in ("started", "failed"):
        return True
    started_ns = ev.ts_ns if ev.kind == "started" else ev.started_ns
    if stage is not None:
        if started_ns is not None and stage.started_ns is None:
            stage.started_ns = started_ns
        if ev.kind in ("stage_done", "finished") and stage.done_ns is None:
            stage.done_ns = ev.ts_ns
    if ev.finish_reason and rec.finish_reason is None:
        rec.finish_reason = ev.finish_reason
    rec.edges.extend(ev.edges)
    if not rec.status.terminal:
        if started_ns is not None:
            rec.status = RequestStatus.RUNNING
            rec.current_stage = max(rec.current_stage, s or 0)
        if ev.kind == "finished":
            rec.status = RequestStatus.COMPLETED
        elif ev.kind == "failed":
            rec.status, rec.error = RequestStatus.FAILED, ev.reason
        elif ev.kind == "aborted":
            rec.status, rec.error = RequestStatus.ABORTED, ev.reason
            rec.finish_reason = "abort"
    rec.updated_ns = max(rec.updated_ns, ev.ts_ns)
    return True
