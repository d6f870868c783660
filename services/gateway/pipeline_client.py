"""The gateway's side of the bus: submit admissions, receive a request's events, abort, health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError as JSAPIError
from nats.js.errors import NoStreamResponseError

from libs.common import headers as h
from libs.common.bus import connect, ensure_topology, services_kv
from libs.common.bus_trust import Rejected
from libs.common.envelopes import (
    AbortNotice,
    Admission,
    ClientEvent,
    LifecycleEvent,
    MalformedMessage,
    ResumePoint,
    ResumeQuery,
    decode,
    unpack_batch,
)
from libs.common.jetstream import JetStream
from libs.common.pipeline import PipelineConfig
from libs.common.publish import PUBLISH_TIMEOUT_S, publish_lifecycle, until_stored
from libs.common.registry import Heartbeat, LiveServices, ServiceKind, ServiceRecord
from libs.common.settings import GatewaySettings
from libs.common.subjects import Subjects
from libs.common.version import VERSION
from services.gateway.errors import APIError
from services.gateway.event_trust import EventTrust
from services.gateway.request_handle import BACKSTOP_S, RequestHandle, timed_out
from services.gateway.schemas import Health

__all__ = ["BACKSTOP_S", "JS_STREAM_FULL", "PipelineClient", "RequestHandle", "timed_out"]

log = logging.getLogger(__name__)

JS_STREAM_FULL = 10077
"""JetStream error code: maximum messages exceeded (the admission queue is full)."""
ASKED_AGAIN_S = 1.0
"""How long the admission's second publish waits for its ack, seconds (after the first timed out)."""


class PipelineClient:
    def __init__(
        self,
        settings: GatewaySettings,
        pipeline: PipelineConfig,
        on_stale: Callable[[int], None],
        on_gap: Callable[[int], None],
        on_rejected: Callable[[Rejected], None],
    ) -> None:
        """``on_stale(stage)`` is told of every event dropped as coming from an old attempt,
        ``on_gap(stage)`` of every gap found in a stage's events (events lost on the way),
        ``on_rejected(reason)`` of every message dropped as forged or stale otherwise
        (:mod:`services.gateway.event_trust`)."""
        self._on_stale = on_stale
        self._on_gap = on_gap
        self.settings = settings
        self.pipeline = pipeline
        self.subjects = Subjects(pipeline.name)
        self.gateway_id = settings.instance_id
        self.trust = EventTrust(pipeline, self.gateway_id, on_rejected)
        self._handles: dict[str, RequestHandle] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._batch_subject = self.subjects.out_batch(self.gateway_id)

    async def start(self) -> None:
        self.nc = await connect(
            self.settings.nats_url,
            f"omnirelay-gateway-{self.gateway_id}",
            on_reconnect=lambda: self._spawn(self._admit_again()),
        )
        self.js = JetStream(self.nc)
        await ensure_topology(self.js, self.subjects)
        await self.nc.subscribe(
            self.subjects.out_wildcard(self.gateway_id),
            cb=self._on_event,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )
        await self.nc.subscribe(self.subjects.resume(self.gateway_id), cb=self._on_resume)
        skv = await services_kv(self.js)
        self.services = LiveServices(
            skv, self.pipeline.name, config=self.pipeline, on_rejected=self._bad_record
        )
        await self.services.start()
        self.all_services = LiveServices(
            skv, None, config=self.pipeline, on_rejected=self._bad_record_elsewhere
        )
        """Every pipeline's services (for Prometheus service discovery)."""
        await self.all_services.start()
        record = ServiceRecord(
            service=ServiceKind.GATEWAY,
            pipeline=self.pipeline.name,
            instance=self.gateway_id,
            metrics_url=f"http://{self.settings.advertise_host}:{self.settings.admin_port}/metrics",
            version=VERSION,
        )
        self._heartbeat = Heartbeat(skv, record, lambda: len(self._handles))
        await self._heartbeat.start()

    async def stop(self) -> None:
        await self._heartbeat.stop()
        await self.services.stop()
        await self.all_services.stop()
        with contextlib.suppress(Exception):
            await self.nc.drain()

    @property
    def inflight(self) -> int:
        return len(self._handles)

    def _bad_record(self, reason: Rejected, _key: str) -> None:
        self.trust.count(reason)

    def _bad_record_elsewhere(self, reason: Rejected, key: str) -> None:
        """A record of every pipeline's view: counted unless it is of this pipeline (the
        pipeline's own view has counted it)."""
        if key.split(".")[1:2] != [self.pipeline.name]:
            self.trust.count(reason)

    def _rejected(self, reason: Rejected, event: ClientEvent, subject: str) -> None:
        self.trust.count(reason)
        log.info(
            "dropped a %s event (request %s, stage %s, replica %s, attempt %d) on %s: %s",
            event.type.value,
            event.request_id,
            event.stage,
            event.replica,
            event.attempt,
            subject,
            reason.value,
        )

    async def _on_event(self, msg: Msg) -> None:
        """One client event on its request's subject, or several (of any requests of this
        gateway) in a worker's batch on ``out.<gateway>.~``, each taken as if it came alone; or a
        worker's question about its attempt's events (a request: :meth:`_on_question`)."""
        if msg.reply:
            await self._on_question(msg)
        elif msg.subject == self._batch_subject:
            try:
                bodies = unpack_batch(msg.data)
            except MalformedMessage as e:
                log.error("dropping a malformed batch of events on %s: %s", msg.subject, e)
                return
            for body in bodies:
                self._take(body, msg.subject, batched=True)
        else:
            self._take(msg.data, msg.subject)

    def _take(self, data: bytes, subject: str, batched: bool = False) -> None:
        """Judge one event (docs/security.md, "What the application checks") and hand it to
        its request; a batched event's subject names only this gateway."""
        try:
            event = decode(ClientEvent, data)
        except MalformedMessage as e:
            log.error("dropping malformed event on %s: %s", subject, e)
            return
        if not batched and not self.trust.subject_names(subject, event.request_id):
            self._rejected(Rejected.SUBJECT_MISMATCH, event, subject)
            return
        handle = self._handles.get(event.request_id)
        if handle is None:
            self.trust.count(self.trust.not_held(event.request_id))
            return
        if (why := self.trust.origin(event, handle.attempts)) is not None:
            self._rejected(why, event, subject)
            return
        if event.stage is not None:  # the attempt's first event binds its replica (when not announced)
            handle.attempts.replica.setdefault((event.stage, event.attempt), event.replica or 0)
        event = self.trust.error_checked(event)
        gaps = handle.gaps
        fenced = handle.fenced(event)
        handle.put(event)
        if handle.gaps > gaps and event.stage is not None:
            self._on_gap(event.stage)
            log.warning(
                "request %s: events of stage %s attempt %d were lost on the way (got seq %d); replica %s "
                "sends them again when it next asks what arrived",
                event.request_id,
                event.stage,
                event.attempt,
                event.seq,
                event.replica,
            )
        elif fenced:
            log.info(
                "request %s: dropped a %s event of stage %s attempt %d (the request moved on)",
                event.request_id,
                event.type.value,
                event.stage,
                event.attempt,
            )
            self._on_stale(event.stage or 0)

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        """Run ``work`` in the background (kept referenced until it ends)."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_question(self, msg: Msg) -> None:
        """Answer the worker running a stage attempt: how far the client's stream of the attempt
        has got (it keeps its events until they are confirmed, and sends the missing ones again:
        services/stage_worker/client_stream.py)."""
        try:
            query = decode(ResumeQuery, msg.data)
        except MalformedMessage as e:
            log.error("ignoring a malformed question on %s: %s", msg.subject, e)
            return
        if not self.trust.subject_names(msg.subject, query.request_id):
            self.trust.count(Rejected.SUBJECT_MISMATCH)
            return
        handle = self._handles.get(query.request_id)
        if handle is None:  # its stream has ended (it had every event), or its client left
            await msg.respond(ResumePoint(known=False).encode())
            return
        if (why := self.trust.question(query, handle.attempts)) is not None:
            self.trust.count(why)
            log.warning("request %s: not answering a question (%s): %s", query.request_id, why.value, query)
            return
        await msg.respond(handle.received(query.stage, query.attempt).encode())

    async def _on_resume(self, msg: Msg) -> None:
        """Answer an orchestrator moving a request: where its client's stream stands."""
        try:
            query = decode(ResumeQuery, msg.data)
        except MalformedMessage as e:
            log.error("ignoring malformed resume query: %s", e)
            return
        handle = self._handles.get(query.request_id)
        why = self.trust.resume(query)
        if handle is None and self.trust.never_held(query.request_id):
            why = Rejected.UNKNOWN_REQUEST
        if why is not None:
            self.trust.count(why)
            log.warning("request %s: not resuming (%s): %s", query.request_id, why.value, query)
        if handle is None or why is not None:
            await msg.respond(ResumePoint(known=False).encode())
            return
        if query.replica is not None:  # the orchestrator binds the new attempt to its replica
            handle.attempts.replica[(query.stage, query.attempt)] = query.replica
        text = query.stage in (self.pipeline.listener_stage, self.pipeline.thinker_stage)
        await msg.respond(handle.resume_point(query.stage, query.attempt, text).encode())

    async def submit(self, adm: Admission, trace_headers: dict[str, str]) -> RequestHandle:
        """Queue ``adm`` for the orchestrators; 429 when the admission queue is full, 503 when
        the bus cannot take it."""
        if not self.nc.is_connected:
            # Not published at all: nats-py would keep it in its reconnect buffer and send it once
            # the broker is back, and the request the client was told 503 would run after all.
            raise APIError(503, "the bus is unavailable: not connected", "bus_unavailable")
        handle = RequestHandle(adm.request_id, adm.deadline_ns)
        self._handles[adm.request_id] = handle
        headers = {
            h.REQUEST_ID: adm.request_id,
            h.ARRIVAL_NS: str(adm.arrival_ns),
            h.MSG_ID: adm.request_id,
            **trace_headers,
        }
        handle.admission = (adm.encode(), headers)
        try:
            data, subject = handle.admission[0], self.subjects.requests
            try:
                await self.js.publish(subject, data, headers=headers, timeout=PUBLISH_TIMEOUT_S)
            except NatsTimeout:
                # Maybe an ack left unread: this process stopped or starved past the timeout runs
                # the due timer first. The same admission again is stored at most once (its
                # Nats-Msg-Id), and the answer says whether the stream has it.
                await self.js.publish(subject, data, headers=headers, timeout=ASKED_AGAIN_S)
        except JSAPIError as e:
            self.release(adm.request_id)
            if e.err_code == JS_STREAM_FULL:
                raise APIError(429, "the admission queue is full; retry later", "queue_full") from None
            raise APIError(503, f"the bus rejected the request: {e.description}", "bus_unavailable") from None
        except (NatsTimeout, NoRespondersError, NoStreamResponseError, ConnectionError) as e:
            # NoStreamResponseError: no stream took the subject (a cluster electing its leader)
            self.release(adm.request_id)
            raise APIError(503, f"the bus is unavailable: {type(e).__name__}", "bus_unavailable") from None
        return handle

    async def _admit_again(self) -> None:
        """After a reconnect, send again the admission of every request that has had no event
        yet. The requests stream acknowledges a write before it is on disk (its persist mode is
        ``async``, docs/reliability.md), so a broker killed just after may come back without
        admissions it acknowledged. A copy of one the stream still holds, or took before within
        its duplicate window, is dropped by its ``Nats-Msg-Id``; one an orchestrator has handled
        is handled again to the same end (``services/orchestrator/admission.py``)."""
        waiting = [
            hd for hd in self._handles.values() if hd.admission is not None and not hd.arrived.is_set()
        ]
        for handle in waiting:
            try:
                await self._admission_stored(handle)
            except Exception as e:  # its deadline passed: the handle's own timer answers the client
                log.warning("request %s: its admission was not sent again: %s", handle.request_id, e)
        if waiting:
            log.info("sent %d admission(s) again after a reconnect", len(waiting))

    async def _admission_stored(self, handle: RequestHandle) -> None:
        """Publish ``handle``'s admission until the stream takes it or its deadline passes."""
        assert handle.admission is not None
        data, headers = handle.admission
        await until_stored(
            self.nc,
            lambda: self.js.publish(self.subjects.requests, data, headers=headers, timeout=PUBLISH_TIMEOUT_S),
            f"the admission of {handle.request_id}",
            lambda: time.time_ns() >= handle.deadline_ns,
        )

    def release(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is not None:
            self.trust.released(request_id)

    def abort(self, request_id: str, reason: str) -> None:
        """Cancel a request in every worker and record it (does not wait)."""
        self.release(request_id)
        self._spawn(self._abort(request_id, reason))

    async def _abort(self, request_id: str, reason: str) -> None:
        try:
            await self.nc.publish(
                self.subjects.abort, AbortNotice(request_id=request_id, reason=reason).encode()
            )
            event = LifecycleEvent(request_id=request_id, kind="aborted", ts_ns=time.time_ns(), reason=reason)
            await publish_lifecycle(self.js, self.subjects, event)
        except Exception as e:
            log.warning("request %s: abort not fully sent: %s", request_id, e)

    def health(self) -> Health:
        """Ready (``ok`` or ``degraded``) when the bus is connected, an orchestrator is live and
        every stage has a live replica; ``degraded`` names the stages with fewer live replicas
        than the pipeline declares (a replica died or stalls and has not come back yet)."""
        stages = {
            f"{i}:{s.name}": len(self.services.live(ServiceKind.WORKER, i))
            for i, s in enumerate(self.pipeline.stages)
        }
        declared = {f"{i}:{s.name}": s.replicas for i, s in enumerate(self.pipeline.stages)}
        degraded = [key for key, live in stages.items() if live < declared[key]]
        orchestrators = len(self.services.live(ServiceKind.ORCHESTRATOR))
        bus = self.nc.is_connected
        ok = bus and orchestrators > 0 and all(stages.values())
        status = ("degraded" if degraded else "ok") if ok else "unavailable"
        return Health(status=status, bus=bus, orchestrators=orchestrators, stages=stages, degraded=degraded)
