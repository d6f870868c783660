"""Which stage replicas are dead: probed while they have work, judged by what the probe meets.

Every ``PROBE_PERIOD_S`` each orchestrator sends a core-NATS request to the liveness subject
(``omni.<p>.ctl.alive.<s>.<r>``) of every replica that has a request bound to it and not finished
there (:class:`~services.orchestrator.inflight.InflightRequests`). The worker answers from its event
loop. Two verdicts:

- ``exit`` — NATS answers "no responders": no connection holds the subscription any more (the
  process is gone; the server notices a closed TCP connection at once). Seen within one probe period
  of a ``kill -9``. Not for :data:`RECONNECT_GRACE_S` after this orchestrator reconnected (a broker
  restart: the workers are reconnecting too).
- ``stall`` — no answer at all for the stage's ``stall_timeout_s`` (pipeline YAML): the process is
  stopped, or its event loop is blocked.
- ``engine_dead`` — the worker answers that its engine died (it exits right after, and is
  started anew by the launcher or compose).

A verdict is about one incarnation of the replica (its ``started_ns`` in ``omni_services``): the
first orchestrator to create its key in ``omni_evictions`` counts and logs it; every orchestrator
then hands the requests bound to it to ``on_dead``, which acts on each through a compare-and-set on
its record (exactly one instance acts per request). Clocks: ``time.monotonic()`` of this process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from libs.common.envelopes import ENGINE_DEAD
from libs.common.pipeline import PipelineConfig
from libs.common.records import RequestRecord
from libs.common.registry import LiveServices, ServiceKind, ServiceRecord
from libs.common.runtime import cancel_and_wait
from libs.common.subjects import Subjects
from services.orchestrator.inflight import InflightRequests

log = logging.getLogger(__name__)

PROBE_PERIOD_S = 0.5
"""Seconds between two probes of a busy replica."""
PROBE_TIMEOUT_S = 1.0
"""How long one probe waits for its answer, seconds."""
RECONNECT_GRACE_S = 5.0
"""After this orchestrator reconnects to NATS (a broker restart), "no responders" is no verdict for
this long, seconds: the workers are reconnecting too (every 0.5 s), and until one has, its
subscription is missing although it lives. Silence still counts towards a stall meanwhile."""


class DeathReason(StrEnum):
    EXIT = "exit"
    STALL = "stall"
    ENGINE_DEAD = "engine_dead"
    LOST_EVENTS = "lost_events"
    """Not a death: the gateway lost events of the replica's attempt and asked for a new one."""


@dataclass(frozen=True)
class Death:
    """One incarnation of replica (stage, replica) judged dead."""

    stage: int
    replica: int
    started_ns: int
    """The incarnation (``started_ns`` of its registry record; 0 when none was ever seen)."""
    reason: DeathReason
    silent_s: float
    """Seconds since its last answer to a probe (or since probing began)."""


def verdict(answer: str, silent_s: float, stall_timeout_s: float, reconnecting: bool) -> DeathReason | None:
    """The verdict on one probe: ``answer`` is ``ok``, ``engine_dead`` (the worker lives, its
    engine does not), ``no_responders`` or ``timeout``;
    ``silent_s`` is how long the replica has not answered (0 after an answer); ``reconnecting``:
    this orchestrator reconnected less than :data:`RECONNECT_GRACE_S` ago."""
    if answer == "ok":
        return None
    if answer == ENGINE_DEAD:
        return DeathReason.ENGINE_DEAD
    if answer == "no_responders" and not reconnecting:
        return DeathReason.EXIT
    if silent_s >= stall_timeout_s:
        return DeathReason.STALL
    return None


class ReplicaWatch:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        pipeline: PipelineConfig,
        inflight: InflightRequests,
        services: LiveServices,
        evictions: KeyValue,
        on_eviction: Callable[[Death], None],
        on_dead: Callable[[Death, RequestRecord], Awaitable[None]],
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._pipeline = pipeline
        self._inflight = inflight
        self._services = services
        self._evictions = evictions
        self._on_eviction = on_eviction
        self._on_dead = on_dead
        self._last_answer: dict[tuple[int, int], float] = {}
        """(stage, replica) → when it last answered, or when probing it began."""
        self._reconnects = 0
        self._grace_until = 0.0
        """No "exit" verdict before this (``time.monotonic()``): see :data:`RECONNECT_GRACE_S`."""
        self._task: asyncio.Task[None] | None = None
        self._judged: dict[tuple[int, int], int] = {}
        """(stage, replica) → the incarnation (``started_ns``) judged dead, until it heartbeats
        again (a replica that resumed after a stall)."""
        services.on_update(self._on_heartbeat)

    def judged_dead(self, rec: ServiceRecord) -> bool:
        """Whether this incarnation of a worker was judged dead and has not heartbeat since (its
        registration lingers for up to the registry's TTL after a ``kill -9``)."""
        judged = self._judged.get((rec.stage or 0, rec.replica or 0))
        return judged is not None and rec.started_ns <= judged

    def _on_heartbeat(self, rec: ServiceRecord) -> None:
        if rec.service == ServiceKind.WORKER:
            self._judged.pop((rec.stage or 0, rec.replica or 0), None)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="replica-watch")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        """Every period, a new probe for each busy replica, whether or not its earlier ones have
        been answered: a probe sent just before a death waits out its timeout, the next one meets
        "no responders" at once. A replica slow to answer delays no other replica's probes."""
        probing: dict[tuple[int, int], set[asyncio.Task[None]]] = {}
        try:
            while True:
                await asyncio.sleep(PROBE_PERIOD_S)
                busy = self._inflight.busy()
                for key in set(self._last_answer) - busy:  # idle again: judged afresh next time
                    del self._last_answer[key]
                for key in busy:
                    tasks = probing.setdefault(key, set())
                    tasks -= {t for t in tasks if t.done()}
                    tasks.add(asyncio.create_task(self._check(*key)))
        finally:
            for tasks in probing.values():
                for task in tasks:
                    task.cancel()

    async def _probe(self, stage: int, replica: int) -> str:
        try:
            reply = await self._nc.request(self._subjects.alive(stage, replica), b"", timeout=PROBE_TIMEOUT_S)
        except NoRespondersError:
            return "no_responders"
        except (NatsTimeoutError, TimeoutError, ConnectionClosedError):
            return "timeout"  # ours is down too: no answer, and no proof of death
        return ENGINE_DEAD if reply.data == ENGINE_DEAD.encode() else "ok"

    async def _check(self, stage: int, replica: int) -> None:
        now = time.monotonic()
        since = self._last_answer.setdefault((stage, replica), now)
        answer = await self._probe(stage, replica)
        if answer == "ok":
            self._last_answer[(stage, replica)] = time.monotonic()
            return
        silent_s = time.monotonic() - since
        reason = verdict(answer, silent_s, self._pipeline.stages[stage].stall_timeout_s, self._reconnecting())
        if reason is None:
            return
        death = Death(stage, replica, self._incarnation(stage, replica), reason, silent_s)
        self._judged[(stage, replica)] = max(death.started_ns, self._judged.get((stage, replica), 0))
        if await self._claim(death):
            self._on_eviction(death)
        await asyncio.gather(*(self._handle(death, rec) for rec in self._inflight.bound_to(stage, replica)))

    async def _handle(self, death: Death, rec: RequestRecord) -> None:
        try:
            await self._on_dead(death, rec)
        except Exception as e:
            log.warning("request %s: handling the death of its replica failed: %s", rec.request_id, e)

    def _reconnecting(self) -> bool:
        """Whether this orchestrator reconnected to NATS less than :data:`RECONNECT_GRACE_S` ago
        (read after each probe: a probe sent during the outage is flushed, and answered, the moment
        the connection is back)."""
        if self._nc.stats["reconnects"] != self._reconnects:
            self._reconnects = self._nc.stats["reconnects"]
            self._grace_until = time.monotonic() + RECONNECT_GRACE_S
        return time.monotonic() < self._grace_until

    def _incarnation(self, stage: int, replica: int) -> int:
        heard = [
            rec for rec, _ in self._services.last_heard(ServiceKind.WORKER, stage) if rec.replica == replica
        ]
        return max((rec.started_ns for rec in heard), default=0)

    async def _claim(self, death: Death) -> bool:
        """True for the one orchestrator that creates the incarnation's eviction key."""
        key = self._subjects.eviction_key(death.stage, death.replica, death.started_ns)
        try:
            await self._evictions.create(key, death.reason.value.encode())
        except KeyWrongLastSequenceError:
            return False
        return True
