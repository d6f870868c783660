"""Which stage replicas are dead: every ``PROBE_PERIOD_S`` each orchestrator asks every replica
with unfinished work bound to it for its :class:`~libs.common.envelopes.Liveness` and judges what
the probe meets (:func:`verdict`; docs/reliability.md, "Probing").

A verdict is about one incarnation of the replica (``started_ns`` in ``omni_services``): the first
orchestrator to create its key in ``omni_evictions`` counts and logs it; every orchestrator hands
the requests bound to it to ``on_dead``. Clocks: ``time.monotonic()`` of this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from libs.common.envelopes import Liveness, MalformedMessage, decode
from libs.common.records import RequestRecord
from libs.common.registry import LiveServices, ServiceKind, ServiceRecord
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.inflight import InflightRequests

log = logging.getLogger(__name__)

PROBE_PERIOD_S = 0.5
"""Seconds between two probes of a busy replica."""
PROBE_TIMEOUT_S = 1.0
"""How long one probe waits for its answer, seconds."""
RECONNECT_GRACE_S = 5.0
"""After this orchestrator reconnects to NATS, "no responders" is no verdict for this long,
seconds: the workers are reconnecting too, their subscriptions missing until they have."""
CLUSTER_EXIT_CONFIRM_S = 1.0
"""Against a NATS cluster (more than one server known), "no responders" is an ``exit`` only once
it has lasted this long, seconds: a worker whose node died is reconnecting to another one."""
ANSWERED_RECENTLY_S = PROBE_PERIOD_S + PROBE_TIMEOUT_S
"""A replica that answered a probe this recently may be routed to even when its registration has
expired, if no other is live (:meth:`ReplicaWatch.answering`), seconds."""


class DeathReason(StrEnum):
    EXIT = "exit"
    STALL = "stall"
    ENGINE_DEAD = "engine_dead"


@dataclass(frozen=True)
class Death:
    """One incarnation of replica (stage, replica) judged dead."""

    stage: int
    replica: int
    started_ns: int
    """The incarnation (``started_ns`` of its registry record; 0 when none was ever seen)."""
    reason: DeathReason
    silent_s: float
    """Seconds since its last answer to a probe (or since probing began); for a hung engine,
    seconds its progress has been flat while it had work."""
    progress: int | None = None
    """A hung engine's flat progress counter (None: the verdict came from silence or an exit)."""

    @property
    def cause(self) -> str:
        """What was seen, for the operator's log line."""
        if self.progress is not None:
            return f"its engine produced nothing while it had work (progress {self.progress})"
        return {
            DeathReason.EXIT: "its connection is gone",
            DeathReason.STALL: "no answer to its probe",
            DeathReason.ENGINE_DEAD: "its engine died",
        }[self.reason]


def verdict(
    answer: str,
    silent_s: float,
    stall_timeout_s: float,
    reconnecting: bool,
    flat_s: float = 0.0,
    exit_confirm_s: float = 0.0,
) -> DeathReason | None:
    """The verdict on one probe: ``answer`` is ``ok``, ``engine_dead``, ``no_responders`` or
    ``timeout``; ``silent_s``: how long the replica has not answered; ``flat_s``: how long its
    answers have shown work under way and no progress; ``reconnecting``: within
    :data:`RECONNECT_GRACE_S` of this orchestrator's reconnect; ``exit_confirm_s``: how long "no
    responders" must have lasted to be an exit. Seconds."""
    if answer == "ok":
        return DeathReason.STALL if flat_s >= stall_timeout_s else None
    if answer == "engine_dead":
        return DeathReason.ENGINE_DEAD
    if answer == "no_responders" and not reconnecting and silent_s >= exit_confirm_s:
        return DeathReason.EXIT
    if silent_s >= stall_timeout_s:
        return DeathReason.STALL
    return None


def judgment_lifted(judged: Death, heartbeat: ServiceRecord) -> bool:
    """Whether ``heartbeat`` (a registry record of the judged replica) makes it routable again:
    a new incarnation always does; otherwise, after ``engine_dead`` nothing does (the worker
    heartbeats on until it exits), after a hung engine a heartbeat showing more progress does, and
    after a silence any heartbeat does."""
    if heartbeat.started_ns > judged.started_ns:
        return True
    if judged.reason == DeathReason.ENGINE_DEAD:
        return False
    if judged.progress is not None:
        return heartbeat.progress > judged.progress
    return True


@dataclass
class BrokerProof:
    """Whether the broker carried this orchestrator's round trips to itself promptly: one slower
    than :data:`PROBE_TIMEOUT_S`, or failed, leaves the broker unproven until its end (until now
    while it is under way). A replica not heard since before that end is silent only from the end
    plus the slow time's length (:meth:`silent_s`): what it produced meanwhile goes out first, and
    its answers queue behind it. Clock: ``time.monotonic()``."""

    unproven_since: float = 0.0
    """When the last slow time began (the start of its first slow or failed round trip)."""
    unproven_until: float = 0.0
    """When the broker was last seen slow (end of the last slow or failed round trip)."""
    outstanding: set[float] = field(default_factory=set)
    """Start times of the round trips under way."""

    def sent(self, now: float) -> None:
        self.outstanding.add(now)

    def done(self, sent_at: float, now: float, ok: bool) -> bool:
        """A round trip begun at ``sent_at`` ended at ``now`` (``ok``: its answer came); whether
        it began a slow time."""
        self.outstanding.discard(sent_at)
        if ok and now - sent_at <= PROBE_TIMEOUT_S:
            return False
        began = sent_at > self.unproven_until
        self.unproven_since = sent_at if began else min(self.unproven_since, sent_at)
        self.unproven_until = max(self.unproven_until, now)
        return began

    def silent_s(self, since: float, now: float) -> float:
        """Seconds of a replica's silence (no answer since ``since``) the broker is not to blame
        for: 0 while a round trip is late; from ``since`` if it answered after the last slow time,
        else from that time's end plus its length."""
        if any(now - t > PROBE_TIMEOUT_S for t in self.outstanding):
            return 0.0
        if since >= self.unproven_until:
            return now - since
        backlog_s = self.unproven_until - self.unproven_since
        return max(0.0, now - self.unproven_until - backlog_s)


@dataclass
class ProgressSeen:
    """What the answers of one replica have shown about its engine (``time.monotonic()``)."""

    value: int
    flat_since: float
    """Since when ``value`` has not changed while the replica had work."""

    def update(self, answer: Liveness, now: float) -> float:
        """Take ``answer`` in; how long progress has been flat with work, seconds."""
        if answer.progress != self.value or answer.busy == 0:
            self.value, self.flat_since = answer.progress, now
        return now - self.flat_since


class ReplicaWatch:
    def __init__(
        self,
        ctx: OrchestratorContext,
        inflight: InflightRequests,
        services: LiveServices,
        evictions: KeyValue,
        on_eviction: Callable[[Death], None],
        on_dead: Callable[[Death, RequestRecord], Awaitable[None]],
        own_alive: str,
    ) -> None:
        """``on_dead`` (which must not raise) gets each request bound to a dead replica;
        ``own_alive``: this orchestrator's own liveness subject, answered from its event loop
        (the round trip of :class:`BrokerProof`, and other orchestrators' probes of this one)."""
        self._nc = ctx.nc
        self._own_alive = own_alive
        self._subjects = ctx.subjects
        self._pipeline = ctx.pipeline
        self._inflight = inflight
        self._services = services
        self._evictions = evictions
        self._on_eviction = on_eviction
        self._on_dead = on_dead
        self._last_answer: dict[tuple[int, int], float] = {}
        """(stage, replica) → when it last answered, or when probing it began."""
        self._answered: dict[tuple[int, int], float] = {}
        """(stage, replica) → when it last answered a probe with a live engine."""
        self._progress: dict[tuple[int, int], ProgressSeen] = {}
        """(stage, replica) → what its answers showed of its engine's progress."""
        self._broker = BrokerProof()
        self._reconnects = 0
        self._grace_until = 0.0
        """No "exit" verdict before this (``time.monotonic()``): see :data:`RECONNECT_GRACE_S`."""
        self._judged: dict[tuple[int, int], Death] = {}
        """(stage, replica) → its death, until a heartbeat lifts it (:func:`judgment_lifted`)."""
        services.on_update(self._on_heartbeat)

    def judged_dead(self, rec: ServiceRecord) -> bool:
        """Whether this incarnation of a worker was judged dead and no heartbeat has lifted that
        (:func:`judgment_lifted`)."""
        judged = self._judged.get((rec.stage or 0, rec.replica or 0))
        return judged is not None and rec.started_ns <= judged.started_ns

    def answering(self, stage: int, replica: int) -> bool:
        """Whether the replica answered a probe, with its engine alive, within the last
        :data:`ANSWERED_RECENTLY_S` (only busy replicas are probed)."""
        at = self._answered.get((stage, replica))
        return at is not None and time.monotonic() - at <= ANSWERED_RECENTLY_S

    def _on_heartbeat(self, rec: ServiceRecord) -> None:
        key = (rec.stage or 0, rec.replica or 0)
        judged = self._judged.get(key)
        if rec.service == ServiceKind.WORKER and judged is not None and judgment_lifted(judged, rec):
            del self._judged[key]

    async def start(self) -> asyncio.Task[None]:
        """Answer this orchestrator's own liveness subject and probe; the probing task (the
        caller cancels it)."""
        await self._nc.subscribe(self._own_alive, cb=_answer)
        return asyncio.create_task(self._run(), name="replica-watch")

    async def _run(self) -> None:
        """Every period, a new probe for each busy replica, whether or not its earlier ones have
        been answered (one sent just before a death waits out its timeout; the next meets "no
        responders" at once)."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(PROBE_PERIOD_S)
                busy = self._inflight.busy()
                running -= {t for t in running if t.done()}
                if busy:
                    running.add(asyncio.create_task(self._ping()))
                for key in set(self._last_answer) - busy:  # idle again: judged afresh next time
                    del self._last_answer[key]
                    self._progress.pop(key, None)
                running |= {asyncio.create_task(self._check(*key)) for key in busy}
        finally:
            for task in running:
                task.cancel()

    async def _ping(self) -> None:
        """One round trip through the broker, for :class:`BrokerProof`: a request to this
        orchestrator's own liveness subject. (Not nats-py's ``flush``: a PONG that comes after its
        timeout meets a cancelled future and ends the connection's read loop.)"""
        sent_at = time.monotonic()
        self._broker.sent(sent_at)
        ok = True
        try:
            await self._nc.request(self._own_alive, b"", timeout=PROBE_TIMEOUT_S + PROBE_PERIOD_S)
        except (NatsError, TimeoutError):  # a timeout, a closed or reconnecting connection
            ok = False
        now = time.monotonic()
        if self._broker.done(sent_at, now, ok):
            log.info(
                "the broker carried this orchestrator's own probe %s after %.2f s: replicas' "
                "silence counts from the end of this slow time plus its length",
                "with an answer" if ok else "without an answer",
                now - sent_at,
            )

    async def _probe(self, stage: int, replica: int) -> tuple[str, Liveness | None]:
        try:
            reply = await self._nc.request(self._subjects.alive(stage, replica), b"", timeout=PROBE_TIMEOUT_S)
        except NoRespondersError:
            return "no_responders", None
        except (NatsTimeoutError, TimeoutError, ConnectionClosedError):
            return "timeout", None  # ours is down too: no answer, and no proof of death
        try:
            answer = decode(Liveness, reply.data)
        except MalformedMessage as e:  # it answered, so its loop runs; nothing more is known
            log.warning("stage %d replica %d: malformed liveness answer: %s", stage, replica, e)
            return "ok", None
        return ("engine_dead" if answer.engine_dead else "ok"), answer

    async def _check(self, stage: int, replica: int) -> None:
        key = (stage, replica)
        since = self._last_answer.setdefault(key, time.monotonic())
        answer, liveness = await self._probe(stage, replica)
        now = time.monotonic()
        flat_s, progress = 0.0, None
        if answer == "ok":
            self._last_answer[key] = self._answered[key] = now
            if liveness is not None:
                seen = self._progress.setdefault(key, ProgressSeen(liveness.progress, now))
                flat_s, progress = seen.update(liveness, now), liveness.progress
        silent_s = self._broker.silent_s(since, now)
        stall_timeout_s = self._pipeline.stages[stage].stall_timeout_s
        exit_confirm_s = CLUSTER_EXIT_CONFIRM_S if len(self._nc.servers) > 1 else 0.0
        reason = verdict(answer, silent_s, stall_timeout_s, self._reconnecting(), flat_s, exit_confirm_s)
        if reason is None:
            return
        silent = flat_s if answer == "ok" else silent_s  # a hung engine: how long it made no progress
        heard = self._services.last_heard(ServiceKind.WORKER, stage)
        incarnation = max((rec.started_ns for rec, _ in heard if rec.replica == replica), default=0)
        death = Death(stage, replica, incarnation, reason, silent, progress)
        if death.started_ns >= getattr(self._judged.get(key), "started_ns", 0):
            self._judged[key] = death
        eviction = self._subjects.eviction_key(stage, replica, death.started_ns)
        with contextlib.suppress(KeyWrongLastSequenceError):  # another orchestrator counted it
            await self._evictions.create(eviction, reason.value.encode())
            self._on_eviction(death)
        await asyncio.gather(*(self._on_dead(death, rec) for rec in self._inflight.bound_to(stage, replica)))

    def _reconnecting(self) -> bool:
        """Whether this orchestrator reconnected to NATS less than :data:`RECONNECT_GRACE_S` ago
        (read after each probe: one sent during the outage is answered once the connection is back)."""
        if self._nc.stats["reconnects"] != self._reconnects:
            self._reconnects = self._nc.stats["reconnects"]
            self._grace_until = time.monotonic() + RECONNECT_GRACE_S
        return time.monotonic() < self._grace_until


async def _answer(msg: Msg) -> None:
    """Answer a probe of this orchestrator: its event loop runs."""
    await msg.respond(b"")
