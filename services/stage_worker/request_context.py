"""What a stage handler sees of one request: its ordered inbox and the ways to send results on."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from opentelemetry.trace import INVALID_SPAN, Span

from libs.common import tracing
from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    EdgeSummary,
    LifecycleEvent,
    ResumeQuery,
    StageTask,
    TaskKind,
)
from libs.common.publish import (
    NOT_NOW,
    Hop,
    publish_core,
    publish_lifecycle,
    publish_task,
    until_connected,
    until_stored,
)
from libs.common.subjects import Subjects
from services.stage_worker.client_stream import ClientStream
from services.stage_worker.event_batcher import ClientEventBatcher
from services.stage_worker.inbox import Delivery, RequestInbox
from services.stage_worker.transfer_stats import TransferStats

log = logging.getLogger(__name__)

STARTED_REPORT_DELAY_S = 0.25
"""A stage still working this long after taking a request's first input reports ``started``, s."""


@dataclass
class Identity:
    stage: int
    replica: int


@dataclass
class Bus:
    nc: NATS
    js: JetStreamContext
    subjects: Subjects
    events: ClientEventBatcher | None = None  # None: each client event is published on its own


@dataclass
class RequestContext:
    """One request inside one worker: created on its first delivery, ended when its task ends."""

    me: Identity
    bus: Bus
    first: StageTask  # the first delivery's envelope: route, gateway, arrival and deadline
    inbox: RequestInbox = field(default_factory=RequestInbox)
    span: Span = INVALID_SPAN  # this request's span in this stage
    stream: ClientStream | None = None  # client events sent and not confirmed
    _out_seq: int = 0
    _client_seq: int = 0
    _started_ns: int | None = None  # when the handler took its first input (wall clock, ns)
    _started_sent: bool = False
    _started_timer: asyncio.TimerHandle | None = None
    _done_fields: dict[str, object] | None = None  # a last stage's stage_done, folded into finished
    _in_hand: dict[int, Delivery] = field(default_factory=dict)
    _edges: dict[tuple[str, str], EdgeSummary] = field(default_factory=dict)
    received_s: float = field(default_factory=time.monotonic)  # first input's arrival (monotonic s)
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    abort_reason: str | None = None
    route: list[int] = field(default_factory=list)  # replica of each stage, as this worker sends
    _next_attempt: int = 1  # the next stage's attempt this worker's chunks go to, and its start_seq
    _next_start: int = 0
    _sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    _released: asyncio.Event = field(default_factory=asyncio.Event)  # clear while chunks are held
    route_notices: int = 0  # holds and releases applied here
    _cleared: asyncio.Event = field(default_factory=asyncio.Event)  # clear while awaiting the verdict
    _refused: bool = False

    def __post_init__(self) -> None:
        self.route = list(self.first.route)
        self._released.set()
        self._cleared.set()
        self._next_attempt, self._next_start = self.first.next_attempt, self.first.next_start_seq
        if self.first.attempt > 1:
            self.inbox = RequestInbox(self.first.start_seq)

    @property
    def request_id(self) -> str:
        return self.first.request_id

    @property
    def attempt(self) -> int:
        return self.first.attempt

    @property
    def is_last_stage(self) -> bool:
        return self.me.stage == len(self.first.route) - 1

    @property
    def seconds_left(self) -> float:
        """Seconds until the request's deadline (wall clock)."""
        return (self.first.deadline_ns - time.time_ns()) / 1e9

    @property
    def aborted(self) -> bool:
        return self.abort_reason is not None

    def abort(self, reason: str) -> None:
        """Make every later inbox or bus step of the handler raise (a task's cancellation can be lost)."""
        self.abort_reason = reason

    def _check_aborted(self) -> None:
        if self.aborted:
            raise asyncio.CancelledError(f"request {self.request_id} aborted")

    async def _ready_to_send(self) -> None:
        """Raise if aborted; wait for the record's verdict if one is pending (a refusal aborts)."""
        self._check_aborted()
        if not self._cleared.is_set():  # only a request's first outputs can meet a pending verdict
            await self._cleared.wait()
            self._check_aborted()

    def await_clearance(self) -> None:
        """Send nothing of this request until :meth:`clear` or :meth:`refuse`."""
        self._cleared.clear()

    @property
    def awaits_clearance(self) -> bool:
        return not self._cleared.is_set()

    def clear(self) -> None:
        """The record allows this start: what waited is sent, in order."""
        self._cleared.set()

    def refuse(self, reason: str) -> None:
        """The record refuses this start: abort the request; nothing it produced is sent."""
        self._refused = True
        self.abort(reason)
        self._cleared.set()

    async def next(self) -> Delivery:
        """The next input in sequence order; the first call stamps the stage's start."""
        self._check_aborted()
        d = await self.inbox.next()
        self._check_aborted()
        self._in_hand[d.task.seq] = d
        if d.transfer is not None:
            self._add_transfer(d.transfer)
        if tracing.enabled():
            self.span.add_event("chunk.received", _chunk_attributes(d))
        if self._started_ns is None:
            self._started_ns = time.time_ns()
            self._started_timer = asyncio.get_running_loop().call_later(
                STARTED_REPORT_DELAY_S, self._report_started
            )
        return d

    async def ack(self, d: Delivery) -> None:
        """Acknowledge an input whose output has been published (a lost ack is no failure)."""
        self._in_hand.pop(d.task.seq, None)
        await until_connected(self.bus.nc)
        try:
            await d.msg.ack()
        except NOT_NOW as e:
            log.info(
                "request %s: input %d not acknowledged (%s)", self.request_id, d.task.seq, type(e).__name__
            )

    def unacked(self) -> list[Delivery]:
        """Inputs received and not yet acknowledged."""
        return [*self._in_hand.values(), *self.inbox.held()]

    async def downstream(self, *, final: bool = False, **payload: object) -> None:
        """Send the next chunk to the next stage's bound replica (waits while it is held)."""
        await self._ready_to_send()
        while True:
            await self._released.wait()
            await self._sending.acquire()
            if self._released.is_set():
                break
            self._sending.release()  # held while this send waited for the lock
        try:
            to_stage = self.me.stage + 1
            hop = Hop(str(self.me.stage), str(self.me.replica), to_stage, self.route[to_stage])
            task = StageTask(
                request_id=self.request_id,
                gateway_id=self.first.gateway_id,
                arrival_ns=self.first.arrival_ns,
                deadline_ns=self.first.deadline_ns,
                route=self.route,
                kind=TaskKind.CHUNK,
                seq=self._out_seq,
                final=final,
                attempt=self._next_attempt,
                from_attempt=self.attempt,
                start_seq=self._next_start if self._next_attempt > 1 else 0,
                **payload,
            )
            self._out_seq += 1
            await until_stored(
                self.bus.nc,
                lambda: publish_task(self.bus.js, self.bus.subjects, task, hop, self.span),
                f"request {self.request_id}: chunk {task.seq} for stage {hop.to_stage}",
            )
        finally:
            self._sending.release()
        if tracing.enabled():
            to = {"omni.to_stage": hop.to_stage, "omni.to_replica": hop.to_replica}
            self.span.add_event("chunk.sent", {"omni.seq": task.seq, "omni.final": final, **to})

    def continue_from(self, seq: int) -> None:
        """Number the next chunk sent downstream ``seq`` (an attempt that took the request over)."""
        self._out_seq = seq

    async def hold(self) -> int:
        """Hold chunks (after a send under way) until :meth:`release`; the next chunk's ``seq``."""
        async with self._sending:
            self.hold_now()
            return self._out_seq

    def hold_now(self) -> None:
        """:meth:`hold` for a request that has sent nothing yet (no send can be under way)."""
        self.route_notices += 1
        self._released.clear()

    def release(self, stage: int, replica: int, attempt: int, start_seq: int) -> None:
        """Send on to ``replica`` of ``stage``, whose ``attempt`` takes chunks from ``start_seq``."""
        self.route_notices += 1
        self.route[stage] = replica
        self._next_attempt, self._next_start = attempt, start_seq
        self._released.set()

    async def client(self, event: ClientEvent) -> None:
        """Send a client event to the request's gateway, stamped with stage, replica, attempt and
        seq, and keep it until the gateway confirms it; waits while the broker is away."""
        await self._ready_to_send()
        event.stage, event.replica, event.seq = self.me.stage, self.me.replica, self._client_seq
        event.attempt = self.attempt
        self._client_seq += 1
        data = event.encode()
        if self.stream is None:
            query = ResumeQuery(
                request_id=self.request_id, stage=self.me.stage, attempt=self.attempt, replica=self.me.replica
            )
            flushed = self.bus.events.flushed if self.bus.events is not None else None
            self.stream = ClientStream(self.bus.nc, self._out_subject, query, flushed)
        if self.bus.events is None:
            await publish_core(self.bus.nc, self._out_subject, data)
        else:
            if not self.bus.nc.is_connected:  # the request's production pauses while the broker is away
                await until_connected(self.bus.nc)
            await self.bus.events.add(self.first.gateway_id, self.request_id, data)
        self.stream.add(data)  # after the sender has it: a question asked from now on leaves after it

    async def client_text(self, text: str, token_ids: list[int]) -> None:
        """:meth:`client` for a text delta (one per streamed token)."""
        event = ClientEvent(
            type=ClientEventType.TEXT, request_id=self.request_id, text=text, token_ids=token_ids
        )
        await self.client(event)

    @cached_property
    def _out_subject(self) -> str:
        return self.bus.subjects.out(self.first.gateway_id, self.request_id)

    def _add_transfer(self, t: TransferStats) -> None:
        edge = (t.from_stage, t.from_replica)
        if (e := self._edges.get(edge)) is None:
            e = self._edges[edge] = EdgeSummary(*edge, t.to_stage, t.to_replica)
        e.hops += 1
        e.bytes += t.size_bytes
        e.tx_s += t.tx_s
        e.rx_s += t.rx_s
        e.in_flight_s += t.in_flight_s

    def _report_started(self) -> None:
        if not self._started_sent:
            self._started_sent = True
            self._send(self._event("started", self._started_ns))

    def close(self) -> None:
        """The request has ended here; its client events are still delivered unless it was aborted."""
        self._no_late_started()
        if self.stream is not None:
            self.stream.finish(0.0 if self.aborted else self.seconds_left)

    def _no_late_started(self) -> None:
        if self._started_timer is not None:
            self._started_timer.cancel()
        self._started_sent = True

    def lifecycle(self, kind: str, **fields: object) -> None:
        """Report a lifecycle event without waiting for it (an ending one carries ``started_ns``
        when ``started`` was not sent; the last stage's ``stage_done`` goes with ``finished``)."""
        if not self._started_sent and self._started_ns is not None:
            fields = {**fields, "started_ns": self._started_ns}
            self._no_late_started()
        if kind == "stage_done":
            fields = {**fields, "edges": list(self._edges.values())}
            if self.is_last_stage:
                self._done_fields = fields
                return
        if kind == "finished" and self._done_fields is not None:
            fields = {**self._done_fields, **fields}
        self._send(self._event(kind, time.time_ns(), **fields))

    def _event(self, kind: str, ts_ns: int, **fields: object) -> LifecycleEvent:
        return LifecycleEvent(
            request_id=self.request_id,
            kind=kind,
            ts_ns=ts_ns,
            stage=self.me.stage,
            replica=self.me.replica,
            attempt=self.attempt,
            **fields,
        )

    def _send(self, event: LifecycleEvent) -> None:
        task = asyncio.create_task(self._send_lifecycle(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_lifecycle(self, event: LifecycleEvent) -> None:
        """Publish ``event``, again while the stream does not take it, until the deadline."""
        what = f"request {self.request_id}: lifecycle event {event.kind}"
        await self._cleared.wait()
        if self._refused:
            return
        try:
            await until_stored(
                self.bus.nc,
                lambda: publish_lifecycle(self.bus.js, self.bus.subjects, event),
                what,
                lambda: self.seconds_left <= 0,
            )
        except Exception as e:
            log.warning("%s not recorded: %s", what, e)


def _chunk_attributes(d: Delivery) -> dict[str, object]:
    attrs: dict[str, object] = {
        "omni.seq": d.task.seq,
        "omni.final": d.task.final,
        "messaging.message.body.size": len(d.msg.data),
    }
    t = d.transfer
    if t is not None:
        attrs |= {
            "omni.from_stage": t.from_stage,
            "omni.from_replica": t.from_replica,
            "omni.transfer.tx_s": t.tx_s,
            "omni.transfer.rx_s": t.rx_s,
            "omni.transfer.in_flight_s": t.in_flight_s,
        }
    return attrs
