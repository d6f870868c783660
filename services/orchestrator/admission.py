"""Admission: an admission from the requests stream becomes a route (one live replica per stage),
stage 0's task and the request's record — or an error to the client when it cannot be served."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from libs.common import headers as h
from libs.common.envelopes import Admission, StageTask, TaskKind, decode
from libs.common.publish import Hop, publish_task
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from libs.common.tracing import context_from_headers, start_span
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.routing import NoLiveReplica
from services.orchestrator.summary import PipelineTally

log = logging.getLogger(__name__)

MAX_CONCURRENT_ADMISSIONS = 64
"""Admissions one orchestrator works on at once."""
RECORD_DEFER_S = 0.005
"""The request record is written this long after stage 0's task is sent, seconds: the broker,
the worker and its engine take the task first on a busy front-end core (A/B at c=1, 400 requests
a side: TTFT p50 -0.2 to -0.5 ms together with the gateway's stream start on ``started``)."""


class Admissions:
    """Admits the requests one orchestrator takes from the admission consumer."""

    def __init__(self, ctx: OrchestratorContext, tally: PipelineTally) -> None:
        self.ctx = ctx
        self._tally = tally

    def _count(self, outcome: str) -> None:
        if self.ctx.metrics.enabled:
            self.ctx.metrics["vllm:omni_orchestrator_admissions"].labels(self.ctx.model, outcome).inc()

    async def admit(self, msg: Msg) -> None:
        adm = decode(Admission, msg.data)
        now = time.time_ns()
        if now >= adm.deadline_ns:
            await self._reject(adm, 504, "timeout", "request expired while waiting for admission")
            await msg.ack()
            self._count("expired")
            return
        stages = self.ctx.pipeline.stages_for(adm.audio)
        try:
            route = self.ctx.picker.route(stages)
        except NoLiveReplica as e:
            name = self.ctx.pipeline.stages[e.stage].name
            message = f"stage {e.stage} ({name}) has no live replica"
            await self._reject(adm, 503, "no_live_replica", message, e.why())
            await msg.ack()
            self._count("no_live_replica")
            return
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        record = RequestRecord(
            request_id=adm.request_id,
            pipeline=self.ctx.pipeline.name,
            gateway_id=adm.gateway_id,
            status=RequestStatus.ADMITTED,
            route=route,
            stages=[
                StageProgress(replica=r, attempts=[StageAttempt(attempt=1, replica=r, bound_ns=now)])
                for r in route
            ],
            attempt=attempt,
            trace_id=adm.trace_id,
            arrival_ns=adm.arrival_ns,
            admitted_ns=now,
            deadline_ns=adm.deadline_ns,
            updated_ns=now,
        )
        task = StageTask(
            request_id=adm.request_id,
            gateway_id=adm.gateway_id,
            arrival_ns=adm.arrival_ns,
            deadline_ns=adm.deadline_ns,
            route=route,
            kind=TaskKind.START,
            seq=0,
            final=True,
            prompt_token_ids=adm.prompt_token_ids,
            sampling=adm.sampling,
        )
        hop = Hop(h.FROM_ORCHESTRATOR, h.FROM_ORCHESTRATOR, 0, route[0])
        span = start_span(
            "omni.admit",
            context_from_headers(msg.headers),
            SpanKind.CONSUMER,
            {"omnirelay.request_id": adm.request_id, "omnirelay.route": route, "messaging.system": "nats"},
        )
        try:
            # The task goes first; the record follows RECORD_DEFER_S later. A worker's first
            # lifecycle event comes after the request's first output, normally after the record
            # (one that still beats it is redelivered). If either fails the admission is
            # redelivered: the record is rewritten and the task's Nats-Msg-Id drops the duplicate.
            await asyncio.gather(
                publish_task(self.ctx.js, self.ctx.subjects, task, hop, span),
                self._write_record(record, RECORD_DEFER_S),
            )
        finally:
            span.end()
        await msg.ack()
        self._count("dispatched")
        self._tally.admitted += 1

    async def _write_record(self, record: RequestRecord, after_s: float) -> None:
        """Put ``record`` into ``omni_requests`` ``after_s`` seconds from now."""
        await asyncio.sleep(after_s)
        await self.ctx.requests.put(record.request_id, record.model_dump_json().encode())

    async def _reject(self, adm: Admission, status: int, code: str, message: str, detail: str = "") -> None:
        """Answer the client with ``message``; the log line adds ``detail`` (for the operator)."""
        log.warning("request %s rejected: %s%s", adm.request_id, message, f"; {detail}" if detail else "")
        await self.ctx.tell_client(adm.request_id, adm.gateway_id, status, code, message)
