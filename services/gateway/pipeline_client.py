"""The gateway's side of the bus: submit admissions, receive a request's events, abort, health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError as JSAPIError
from nats.js.errors import NoStreamResponseError

from libs.common import headers as h
from libs.common.bus import connect, ensure_topology, services_kv
from libs.common.envelopes import (
    AbortNotice,
    Admission,
    ClientEvent,
    ClientEventType,
    LifecycleEvent,
    MalformedMessage,
    Replay,
    ReplayAsk,
    ResumePoint,
    ResumeQuery,
    Resync,
    StageEnded,
    TextDelta,
    decode,
    decode_or_log,
)
from libs.common.jetstream import JetStream
from libs.common.pipeline import Payload, PipelineConfig
from libs.common.publish import PUBLISH_TIMEOUT_S, publish_lifecycle
from libs.common.registry import Heartbeat, LiveServices, ServiceKind, ServiceRecord
from libs.common.settings import GatewaySettings
from libs.common.subjects import Subjects
from libs.common.version import VERSION
from services.gateway.errors import APIError
from services.gateway.schemas import Health

log = logging.getLogger(__name__)

JS_STREAM_FULL = 10077
"""JetStream error code: maximum messages exceeded (the admission queue is full)."""


RESYNC_TIMEOUT_S = 2.0
"""How long the gateway waits for an orchestrator to take a resync, seconds."""
RESYNC_RETRY_S = 0.5
"""Pause before a resync not taken is asked again, seconds."""
REPLAY_TIMEOUT_S = 1.0
"""How long the gateway waits for a worker to send lost events again, seconds."""
REPLAY_RETRY_S = 0.2
"""Pause before a replay that got no answer is asked again, seconds."""
REPAIR_S = 2.0
"""A gap not filled by replays this long after it was found is given up, seconds."""
RESYNC_CONFIRM_S = 2.0
"""A resync taken is asked again when no new attempt has asked where the client stands this long
after, seconds."""
BACKSTOP_S = 3.0
"""The gateway's own timeout fires this long after a request's deadline, seconds."""
TAIL_GRACE_S = 1.0
"""After a stage's end notice, how long its missing last events may still be on their way before
they count as lost, seconds (they left before the notice, which took a longer path)."""


class RequestHandle:
    """The events of one submitted request, in arrival order, bounded by its deadline.

    It also keeps where the client's stream stands — the thinker's text deltas so far and
    whether its ``text_done`` came — and, per stage, the oldest attempt still let through: when a
    request moves to another replica the orchestrator asks for that position and raises the
    fence in one step (:meth:`resume_point`), so the new attempt goes on exactly where the
    client is and nothing the old one still sends gets through."""

    def __init__(self, request_id: str, deadline_ns: int) -> None:
        self.request_id = request_id
        self.deadline_ns = deadline_ns
        self.queue: asyncio.Queue[ClientEvent] = asyncio.Queue()
        self.first: ClientEvent | None = None
        """The request's first event (stays here after it is taken from the queue)."""
        self.arrived = asyncio.Event()
        """Set with the first event."""
        self._fence: dict[int, int] = {}
        """Stage → the oldest attempt whose events are let through."""
        self._deltas: list[TextDelta] = []
        self._text_done = False
        self._next_seq: dict[tuple[int, int], int] = {}
        """(stage, attempt) → the ``seq`` of the next event expected from it."""
        self.gaps = 0
        """Events found missing (each gap once)."""
        self.gap: tuple[int, int] | None = None
        """(stage, attempt) of the thinker attempt fenced off for a gap, until it is resynced."""
        self.gapped: dict[tuple[int, int], int] = {}
        """(stage, attempt) with events missing and later ones waiting → the replica that sent them."""
        self._held: dict[tuple[int, int], dict[int, ClientEvent]] = {}
        """Events that came after a gap, by ``seq``, until the gap is filled or given up."""
        self._audio_seq: dict[int, int] = {}
        """Stage → the last input chunk whose audio arrived."""
        self._audio_done: set[int] = set()
        self._sample_rate = 0
        """Of the last audio event."""

    def put(self, event: ClientEvent) -> bool:
        """Take ``event`` unless it comes from a fenced-off attempt or was taken already (then
        False). Events of a stage attempt reach the client in ``seq`` order: one that comes after
        a gap (events lost on the way: a broker restart drops what it held) waits here, and the
        gap is named in :attr:`gapped` for the gateway to have the sender replay it
        (:meth:`PipelineClient._repair`); a gap that cannot be filled is given up
        (:meth:`give_up`)."""
        if self.fenced(event):
            return False
        if event.stage is None:
            return self._take(event)
        key = (event.stage, event.attempt)
        expected = self._next_seq.get(key, 0)
        if event.seq < expected:
            return False  # sent again (a replay) and also arrived the usual way
        if event.seq > expected:
            held = self._held.setdefault(key, {})
            if event.seq in held:
                return False
            held[event.seq] = event
            if key not in self.gapped:
                self.gapped[key] = event.replica or 0
                self.gaps += 1
            return True
        self._next_seq[key] = expected + 1
        taken = self._take(event)
        held = self._held.get(key)
        if held is not None:  # events waited behind this one
            while self._next_seq[key] in held:
                self._take(held.pop(self._next_seq[key]))
                self._next_seq[key] += 1
            if not held:
                del self._held[key]
                self.gapped.pop(key, None)
        return taken

    def fenced(self, event: ClientEvent) -> bool:
        """Whether ``event`` comes from an attempt older than the client's stream now takes."""
        return event.stage is not None and event.attempt < self._fence.get(event.stage, 1)

    def next_seq(self, key: tuple[int, int]) -> int:
        """The ``seq`` of the next event the client's stream takes from stage attempt ``key``."""
        return self._next_seq.get(key, 0)

    def hole(self, key: tuple[int, int]) -> tuple[int, int]:
        """The first gap of a stage attempt: the ``seq`` of its first missing event and of the
        first event waiting after it."""
        return self.next_seq(key), min(self._held[key])

    def give_up(self, key: tuple[int, int]) -> None:
        """The gap of ``key`` cannot be filled. The thinker's attempt is fenced off at the last
        event the client has (:attr:`gap`; the request goes on as a new attempt from there); a
        later stage's stream skips the lost events."""
        stage, attempt = key
        held = self._held.pop(key, {})
        self.gapped.pop(key, None)
        if stage == 0:
            self._fence[0] = attempt + 1
            self.gap = (0, attempt)
            return
        for seq in sorted(held):
            self._next_seq[key] = seq + 1
            self._take(held[seq])

    def _take(self, event: ClientEvent) -> bool:
        """Let ``event`` through to the client (False: an audio chunk the client has)."""
        if event.type == ClientEventType.TEXT:
            self._deltas.append(TextDelta(token_ids=event.token_ids, text=event.text))
        elif event.type == ClientEventType.TEXT_DONE:
            self._text_done = True
        elif event.type == ClientEventType.AUDIO and event.stage is not None and event.in_seq is not None:
            if event.in_seq <= self._audio_seq.get(event.stage, -1):
                return False  # the attempt after a move decoded a chunk the client has
            self._audio_seq[event.stage] = event.in_seq
            self._sample_rate = event.sample_rate or self._sample_rate
        elif event.type == ClientEventType.AUDIO_DONE and event.stage is not None:
            self._audio_done.add(event.stage)
        if self.first is None:
            self.first = event
            self.arrived.set()
        self.queue.put_nowait(event)
        return True

    def resume_point(self, stage: int, attempt: int) -> ResumePoint:
        """Let only ``attempt`` and later of ``stage`` through from now on, and say where the
        client's stream stands (a gap of an older attempt is resynced by this)."""
        self._fence[stage] = max(self._fence.get(stage, 1), attempt)
        if self.gap is not None and self.gap[0] == stage and self.gap[1] < attempt:
            self.gap = None
        if stage != 0:
            return ResumePoint(
                known=True, audio_seq=self._audio_seq.get(stage), audio_done=stage in self._audio_done
            )
        return ResumePoint(known=True, deltas=list(self._deltas), text_done=self._text_done)

    def missing(self, ended: StageEnded) -> int:
        """How many of the events that ``ended``'s stage attempt sent have not arrived here, when
        it is still the attempt the client's stream depends on (0 once a later attempt took over:
        that one ends the stream)."""
        superseded = ended.attempt < self._fence.get(ended.stage, 1) and self.gap != (
            ended.stage,
            ended.attempt,
        )
        if superseded:
            return 0
        return max(ended.client_events - self._next_seq.get((ended.stage, ended.attempt), 0), 0)

    def end_tail(self, ended: StageEnded, audio: bool) -> ClientEvent:
        """End the stage's part of the stream whose last events were lost (:meth:`missing` > 0):
        the last event alone (``text_done``, ``audio_done``) is made from what ``ended`` says;
        more is an ``events_lost`` error. Returns the event put in the stream."""
        missing = self.missing(ended)
        if missing == 1:
            last = ClientEvent(
                request_id=self.request_id,
                type=ClientEventType.AUDIO_DONE if audio else ClientEventType.TEXT_DONE,
                stage=ended.stage,
                attempt=ended.attempt,
                seq=ended.client_events - 1,
                finish_reason=None if audio else ended.finish_reason,
                usage=None if audio else ended.usage,
                sample_rate=self._sample_rate if audio else 0,
            )
        else:
            last = ClientEvent(
                request_id=self.request_id,
                type=ClientEventType.ERROR,
                status=502,
                code="events_lost",
                message=f"the last {missing} events of stage {ended.stage} were lost on their way to the "
                "gateway (a broker restart drops what it holds); the response is incomplete",
            )
        self.put(last)
        return last

    @property
    def seconds_left(self) -> float:
        """Time until the gateway's own timeout: ``BACKSTOP_S`` after the request's deadline
        (workers and orchestrators normally answer at the deadline itself; this covers a bus or
        orchestrator outage), seconds."""
        return (self.deadline_ns - time.time_ns()) / 1e9 + BACKSTOP_S

    async def events(self) -> AsyncIterator[ClientEvent]:
        """Yield events until the caller stops; raises :func:`timed_out` when nothing has ended
        the request within :attr:`seconds_left`."""
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
                # (a client hang-up) that arrives together with an event.
                async with asyncio.timeout(max(self.seconds_left, 0.0)):
                    event = await self.queue.get()
            except TimeoutError:
                raise timed_out() from None
            yield event


def timed_out() -> APIError:
    return APIError(504, "the request did not finish before its deadline", "timeout")


class PipelineClient:
    def __init__(
        self,
        settings: GatewaySettings,
        pipeline: PipelineConfig,
        on_stale: Callable[[int], None],
        on_gap: Callable[[int], None],
    ) -> None:
        """``on_stale(stage)`` is told of every event dropped as coming from an old attempt,
        ``on_gap(stage)`` of every gap found in a stage's events (events lost on the way)."""
        self._on_stale = on_stale
        self._on_gap = on_gap
        self.settings = settings
        self.pipeline = pipeline
        self.subjects = Subjects(pipeline.name)
        self.gateway_id = settings.instance_id
        self._handles: dict[str, RequestHandle] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, f"omnirelay-gateway-{self.gateway_id}")
        self.js = JetStream(self.nc)
        await ensure_topology(self.js, self.subjects)
        await self.nc.subscribe(
            self.subjects.out_wildcard(self.gateway_id),
            cb=self._on_event,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )
        await self.nc.subscribe(self.subjects.resume(self.gateway_id), cb=self._on_resume)
        await self.nc.subscribe(self.subjects.ended(self.gateway_id), cb=self._on_ended)
        skv = await services_kv(self.js)
        self.services = LiveServices(skv, self.pipeline.name)
        await self.services.start()
        self.all_services = LiveServices(skv, None)
        """Every pipeline's services (for Prometheus service discovery)."""
        await self.all_services.start()
        record = ServiceRecord(
            service=ServiceKind.GATEWAY,
            pipeline=self.pipeline.name,
            instance=self.gateway_id,
            metrics_url=f"http://{self.settings.advertise_host}:{self.settings.port}/metrics",
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

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode(ClientEvent, msg.data)
        except MalformedMessage as e:
            log.error("dropping malformed event on %s: %s", msg.subject, e)
            return
        handle = self._handles.get(event.request_id)
        if handle is None:
            return
        gaps = handle.gaps
        fenced = handle.fenced(event)
        handle.put(event)
        if handle.gaps > gaps and event.stage is not None:
            self._on_gap(event.stage)
            log.warning(
                "request %s: events of stage %s attempt %d were lost on the way (got seq %d); asking "
                "replica %s to send them again",
                event.request_id,
                event.stage,
                event.attempt,
                event.seq,
                event.replica,
            )
            self._spawn(self._repair(handle, (event.stage, event.attempt)))
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

    async def _on_ended(self, msg: Msg) -> None:
        """A stage that streams to the client ended its part of a request: if some of its events
        have not arrived ``TAIL_GRACE_S`` later, they were lost, and the stream is ended here."""
        ended = decode_or_log(StageEnded, msg.data, "end notice", log)
        handle = None if ended is None else self._handles.get(ended.request_id)
        if ended is None or handle is None or not handle.missing(ended):
            return
        self._spawn(self._end_tail(handle, ended))

    async def _end_tail(self, handle: RequestHandle, ended: StageEnded) -> None:
        await asyncio.sleep(TAIL_GRACE_S)  # the events may still be on their way
        key = (ended.stage, ended.attempt)
        deadline = time.monotonic() + REPAIR_S + REPLAY_TIMEOUT_S
        while key in handle.gapped and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # a replay is filling a gap
        deadline = time.monotonic() + REPAIR_S  # the last events: the worker may still have them
        replayed = 0
        while handle.missing(ended) and key not in handle.gapped and time.monotonic() < deadline:
            got = await self._replay(handle, key, ended.replica, handle.next_seq(key), ended.client_events)
            replayed += got
            if not got:
                await asyncio.sleep(REPLAY_RETRY_S)
        if replayed:
            log.info(
                "request %s: the last %d event(s) of stage %d attempt %d were sent again",
                ended.request_id,
                replayed,
                ended.stage,
                ended.attempt,
            )
        missing = handle.missing(ended)
        if not missing or self._handles.get(ended.request_id) is not handle:
            return
        self._on_gap(ended.stage)
        audio = self.pipeline.stages[ended.stage].emits == Payload.AUDIO
        last = handle.end_tail(ended, audio)
        log.warning(
            "request %s: the last %d event(s) of stage %d attempt %d never arrived; the stream ends with %s",
            ended.request_id,
            missing,
            ended.stage,
            ended.attempt,
            last.code or last.type.value,
        )

    async def _repair(self, handle: RequestHandle, key: tuple[int, int]) -> None:
        """Have the worker that sent a stage attempt's events send the lost ones again (it keeps
        what it sent: services/stage_worker/sent_events.py), until the gap is filled; when it
        cannot be within ``REPAIR_S`` (the worker is gone, or forgot them), give the gap up: the
        thinker's request then goes on as a new attempt (:meth:`_resync`), a later stage's stream
        skips what was lost."""
        stage, attempt = key
        replica, rid = handle.gapped.get(key, 0), handle.request_id
        deadline = time.monotonic() + REPAIR_S
        replayed = 0
        while key in handle.gapped and self._handles.get(rid) is handle and time.monotonic() < deadline:
            got = await self._replay(handle, key, replica, *handle.hole(key))
            replayed += got
            if not got:
                await asyncio.sleep(REPLAY_RETRY_S)
        if key not in handle.gapped or self._handles.get(rid) is not handle:
            log.info(
                "request %s: %d lost event(s) of stage %d attempt %d sent again",
                rid,
                replayed,
                stage,
                attempt,
            )
            return
        handle.give_up(key)
        log.warning(
            "request %s: the lost events of stage %d attempt %d could not be sent again%s",
            rid,
            stage,
            attempt,
            "; resyncing it" if stage == 0 else "; the audio skips them",
        )
        if stage == 0:
            self._spawn(self._resync(Resync(request_id=rid, stage=0, attempt=attempt)))

    async def _replay(
        self, handle: RequestHandle, key: tuple[int, int], replica: int, first: int, upto: int
    ) -> int:
        """Ask worker (stage, ``replica``) for events ``first`` to ``upto - 1`` of the attempt
        ``key`` and put those it sends in the stream; how many it sent."""
        stage, attempt = key
        ask = ReplayAsk(request_id=handle.request_id, attempt=attempt, from_seq=first, to_seq=upto)
        try:
            msg = await self.nc.request(
                self.subjects.replay(stage, replica), ask.encode(), timeout=REPLAY_TIMEOUT_S
            )
            reply = decode(Replay, msg.data)
        except Exception:  # no responders (gone, or not reconnected yet), timeout, malformed
            return 0
        for raw in reply.events:
            handle.put(decode(ClientEvent, raw))
        return len(reply.events)

    async def _resync(self, ask: Resync) -> None:
        """Ask an orchestrator to resync a request until the new attempt has asked where the
        client stands (:meth:`RequestHandle.resume_point` clears the gap), or the request has
        ended here. The gap is usually found right after a broker restart, when the orchestrators
        may not have resubscribed yet, or may take it while JetStream is still recovering and
        find nothing to move: asking again is safe (a request that moved is not moved twice)."""
        while (handle := self._handles.get(ask.request_id)) is not None and handle.gap == (0, ask.attempt):
            try:
                await self.nc.request(self.subjects.resync, ask.encode(), timeout=RESYNC_TIMEOUT_S)
            except Exception as e:  # no responders, timeout, reconnecting: ask again
                log.info(
                    "request %s: resync not taken yet (%s); asking again", ask.request_id, type(e).__name__
                )
                await asyncio.sleep(RESYNC_RETRY_S)
                continue
            deadline = time.monotonic() + RESYNC_CONFIRM_S
            while handle.gap == (0, ask.attempt) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if handle.gap == (0, ask.attempt) and ask.request_id in self._handles:
                log.info("request %s: resync taken but nothing moved yet; asking again", ask.request_id)

    async def _on_resume(self, msg: Msg) -> None:
        """Answer an orchestrator moving a request: where its client's stream stands."""
        try:
            query = decode(ResumeQuery, msg.data)
        except MalformedMessage as e:
            log.error("ignoring malformed resume query: %s", e)
            return
        handle = self._handles.get(query.request_id)
        point = (
            ResumePoint(known=False) if handle is None else handle.resume_point(query.stage, query.attempt)
        )
        await msg.respond(point.encode())

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
        try:
            await self.js.publish(
                self.subjects.requests, adm.encode(), headers=headers, timeout=PUBLISH_TIMEOUT_S
            )
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

    def release(self, request_id: str) -> None:
        self._handles.pop(request_id, None)

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
