"""Admission: an admission from the requests stream becomes a route (one live replica per stage),
the request's record and its entry stage's task — or an error to the client when it cannot be served.
Every handling of a (redelivered) admission is idempotent (docs/reliability.md, "An orchestrator dies").
"""

from __future__ import annotations

import itertools
import logging
import time

from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry.trace import SpanKind

from libs.common import headers as h
from libs.common.envelopes import Admission, MalformedMessage, StageTask, TaskKind, decode
from libs.common.pipeline import PipelineConfig
from libs.common.publish import Hop, publish_task
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from libs.common.tracing import context_from_headers, start_span
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.routing import NoLiveReplica
from services.orchestrator.summary import PipelineTally

log = logging.getLogger(__name__)

MAX_CONCURRENT_ADMISSIONS = 64
"""Admissions one orchestrator works on at once."""
SKIPPED = -1
"""The route's replica of a stage a request does not run (before its ``entry_stage``)."""


def entry_tasks(adm: Admission, route: list[int]) -> list[StageTask]:
    """The input of the stage ``adm`` enters at: the whole input in one ``start`` task (the
    listener's audio, the thinker's prompt), or a speech request's text chunks for the talker,
    numbered from 0, the last one ``final``, each with the position of its first token among the
    request's (as a thinker's text chunks are)."""
    common = dict(
        request_id=adm.request_id,
        gateway_id=adm.gateway_id,
        arrival_ns=adm.arrival_ns,
        deadline_ns=adm.deadline_ns,
        route=route,
    )
    if not adm.text_chunks:
        return [
            StageTask(
                **common,
                kind=TaskKind.START,
                seq=0,
                final=True,
                prompt_token_ids=adm.prompt_token_ids,
                sampling=adm.sampling,
                transcription=adm.transcription,
            )
        ]
    offsets = [0, *itertools.accumulate(len(c.token_ids) for c in adm.text_chunks)]
    return [
        StageTask(
            **common,
            kind=TaskKind.CHUNK,
            seq=i,
            final=i == len(adm.text_chunks) - 1,
            text=c.text,
            token_ids=c.token_ids,
            offset=offsets[i],
        )
        for i, c in enumerate(adm.text_chunks)
    ]


def _bad_entry(adm: Admission, pipeline: PipelineConfig) -> str | None:
    """Why ``adm`` cannot enter where it says (None: it can). The gateway enters a transcription
    at the listener, a chat or completion at the thinker, a speech request (audio out, its own
    text chunks) at the talker; an admission that would send nothing is no request
    (tests/e2e/test_fuzz_bus.py)."""
    entry = adm.entry_stage
    if entry == pipeline.listener_stage:
        ok = adm.transcription is not None and bool(adm.transcription.pcm16) and not adm.audio
        return None if ok else "a listener's request carries audio to transcribe and wants no audio out"
    if adm.transcription is not None:
        return "only the listener takes audio to transcribe"
    if entry == pipeline.thinker_stage:
        ok = adm.sampling is not None and bool(adm.prompt_token_ids) and not adm.text_chunks
        return None if ok else "the thinker's request carries a prompt and sampling, no text chunks"
    if entry == pipeline.speech_stage:
        ok = bool(adm.audio and adm.text_chunks)
        return None if ok else "a speech request carries text chunks and wants audio"
    return "no request enters there"


class Admissions:
    """Admits the requests one orchestrator takes from the admission consumer."""

    def __init__(self, ctx: OrchestratorContext, tally: PipelineTally) -> None:
        self.ctx = ctx
        self._tally = tally

    async def admit(self, msg: Msg) -> None:
        """Route one admission, create its record and send the entry stage its input, or answer
        the client why not; acknowledged once one of those is done."""
        adm = decode(Admission, msg.data)
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        route = await self._route(adm, delivered)
        if route is not None:
            route = await self._bind(self._record(adm, route, delivered))
        if route is None:  # rejected, or an earlier handling dispatched it and it has gone on since
            await msg.ack()
            return
        tasks = entry_tasks(adm, route)
        hop = Hop(h.FROM_ORCHESTRATOR, h.FROM_ORCHESTRATOR, adm.entry_stage, route[adm.entry_stage])
        attrs = {"omnirelay.request_id": adm.request_id, "omnirelay.route": route, "messaging.system": "nats"}
        span = start_span("omni.admit", context_from_headers(msg.headers), SpanKind.CONSUMER, attrs)
        try:
            acks = [await publish_task(self.ctx.js, self.ctx.subjects, t, hop, span) for t in tasks]
        finally:
            span.end()
        if acks[0].duplicate:  # an earlier handling sent it (and died, or stalled, before its ack)
            log.info(
                "request %s: admission delivered %d times; its task was sent before",
                adm.request_id,
                delivered,
            )
        else:  # counted by the handling whose (first) task the stream stored: once
            self.ctx.count("vllm:omni_orchestrator_admissions", "dispatched")
            self._tally.admitted += 1
        await msg.ack()

    async def _route(self, adm: Admission, delivered: int) -> list[int] | None:
        """A live replica per stage the request runs (:data:`SKIPPED` before its entry stage), or
        None when the request is answered with an error instead: it expired, or a stage has no
        live replica."""
        if time.time_ns() >= adm.deadline_ns:
            await self._reject(adm, delivered, "timeout", "request expired while waiting for admission")
            return None
        entry = adm.entry_stage
        if (why := _bad_entry(adm, self.ctx.pipeline)) is not None:
            raise MalformedMessage(f"entry stage {entry}: {why}", "bad_entry")
        if self.ctx.pipeline.too_far(adm.deadline_ns, time.time_ns()):
            raise MalformedMessage("its deadline lies past the pipeline's request timeout", "bad_deadline")
        try:
            stages = self.ctx.pipeline.stages_for(adm.audio, entry)
            return [SKIPPED] * entry + [self.ctx.picker.pick(s) for s in stages]
        except NoLiveReplica as e:
            name = self.ctx.pipeline.stages[e.stage].name
            message = f"stage {e.stage} ({name}) has no live replica"
            await self._reject(adm, delivered, "no_live_replica", message, e.why())
            return None

    def _record(self, adm: Admission, route: list[int], delivered: int) -> RequestRecord:
        """The request's record as admitted now, every stage it runs bound to ``route``."""
        now, entry = time.time_ns(), adm.entry_stage
        return RequestRecord(
            request_id=adm.request_id,
            pipeline=self.ctx.pipeline.name,
            gateway_id=adm.gateway_id,
            status=RequestStatus.ADMITTED,
            route=route,
            stages=[
                StageProgress(replica=r, attempts=[StageAttempt(attempt=1, replica=r, bound_ns=now)])
                if s >= entry
                else StageProgress(replica=SKIPPED, done_ns=now)
                for s, r in enumerate(route)
            ],
            attempt=delivered,
            trace_id=adm.trace_id,
            voice=adm.voice,
            entry_stage=entry,
            arrival_ns=adm.arrival_ns,
            admitted_ns=now,
            deadline_ns=adm.deadline_ns,
            updated_ns=now,
        )

    async def _bind(self, record: RequestRecord) -> list[int] | None:
        """Create ``record`` and return its route; when an earlier handling of the same admission
        created it, that record's route (the task goes where the record says), or None when the
        request has started or moved since (its task was delivered)."""
        try:
            await self.ctx.requests.create(record.request_id, record.model_dump_json().encode())
            return record.route
        except KeyWrongLastSequenceError:
            pass
        entry = await self.ctx.requests.get(record.request_id)
        earlier = RequestRecord.model_validate_json(entry.value)
        fresh = earlier.status == RequestStatus.ADMITTED and earlier.stages[earlier.entry_stage].attempt <= 1
        return earlier.route if fresh else None

    async def _reject(
        self, adm: Admission, delivered: int, code: str, message: str, detail: str = ""
    ) -> None:
        """Answer the client with 504 ``timeout`` or 503 ``code`` (the log line adds ``detail``, for
        the operator), counted on the admission's first delivery only (a redelivered copy is
        answered again, harmlessly: the gateway took the first answer)."""
        log.warning("request %s rejected: %s%s", adm.request_id, message, f"; {detail}" if detail else "")
        timeout = code == "timeout"
        await self.ctx.tell_client(adm.request_id, adm.gateway_id, 504 if timeout else 503, code, message)
        if delivered <= 1:
            self.ctx.count("vllm:omni_orchestrator_admissions", "expired" if timeout else code)
