"""Moving requests off dead replicas: the sequence that drives the bus (the decisions on the
record are :mod:`~services.orchestrator.migration`'s pure functions; docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import RawStreamMsg
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from libs.common import headers as h
from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    ResumePoint,
    ResumeQuery,
    RouteNotice,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.publish import Hop, publish_task
from libs.common.record_updates import update_record
from libs.common.records import RequestRecord, RequestStatus
from libs.common.registry import LiveServices, ServiceKind
from libs.common.tracing import context_from_headers, start_span
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.inflight import InflightRequests
from services.orchestrator.liveness import Death
from services.orchestrator.migration import (
    Move,
    NoMove,
    Phase,
    apply_move,
    plan_move,
    still_bound,
    stored_inputs,
    unfinished_moves,
)
from services.orchestrator.routing import NoLiveReplica

log = logging.getLogger(__name__)

NO_REPLICA_POLL_S = 0.2
"""How often a request waiting for a live replica to move to looks again, seconds."""
RESUME_TIMEOUT_S = 2.0
"""How long a move waits for each answer of the gateway or an upstream worker, seconds."""
REROUTE_TRIES = 3
"""How many times a move asks a question (the gateway's resume point, an upstream's hold or
release) before it takes the silence for a death."""
MOVE_CHECK_PERIOD_S = 0.5
"""How often an orchestrator looks for moves whose claimer died before carrying them out, seconds."""
MOVE_TAKEOVER_S = 0.5
"""A move claimed this long ago and not carried out is taken over once its claimer is gone (its
probe meets "no responders", or its registration has expired), seconds."""
CLAIMER_PROBE_TIMEOUT_S = 0.5
"""How long a probe of a claimer waits for its answer, seconds."""


class Mover:
    """Counts this orchestrator's verdicts, moves or fails the requests bound to dead replicas and
    takes over moves whose claimer died."""

    def __init__(
        self, ctx: OrchestratorContext, index: InflightRequests, services: LiveServices, instance_id: str
    ) -> None:
        self.ctx = ctx
        self._index = index
        self.services = services
        self.instance_id = instance_id
        self._moving: set[str] = set()
        """Requests this instance is moving or failing after their replica's death."""

    def evicted(self, death: Death) -> None:
        """This instance was the first to judge ``death``: count it and tell the operator."""
        stage = self.ctx.pipeline.stages[death.stage]
        log.warning(
            "stage %d (%s) replica %d is dead (%s: %s for %.1f s); %d request(s) bound to it",
            death.stage,
            stage.name,
            death.replica,
            death.reason,
            death.cause,
            death.silent_s,
            len(self._index.bound_to(death.stage, death.replica)),
        )
        labels = (str(death.stage), str(death.replica), death.reason.value)
        self.ctx.count("vllm:omni_replica_evictions", *labels)

    async def replica_died(self, death: Death, seen: RequestRecord) -> None:
        """A request bound to a dead replica: it moves to a live replica of the stage, or fails
        now (503 ``no_live_replica`` after the stage's ``no_replica_wait_s``, 503
        ``migration_limit`` past its ``migration_limit``)."""
        if seen.request_id not in self._moving:  # the watch hands it over every probe period
            work = self._move_or_fail(death, seen)
            await self._exclusively(seen.request_id, work, "handling the death of its replica")

    async def _exclusively(self, request_id: str, work: Awaitable[None], what: str) -> None:
        """Await ``work`` with ``request_id`` among those this instance is moving; log its failure."""
        self._moving.add(request_id)
        try:
            await work
        except Exception as e:
            log.warning("request %s: %s failed: %s", request_id, what, e)
        finally:
            self._moving.discard(request_id)

    async def _move_or_fail(self, death: Death, seen: RequestRecord) -> None:
        t0 = time.monotonic()
        s, stage = death.stage, self.ctx.pipeline.stages[death.stage]
        where = f"stage {s} ({stage.name}) replica {death.replica}"
        deadline = t0 + stage.no_replica_wait_s
        while True:
            try:
                target = self.ctx.picker.pick(s)
                break
            except NoLiveReplica:
                if time.monotonic() >= deadline:
                    why = f"died ({death.reason}) and the stage has no live replica to move the request to"
                    await self._fail(seen, "no_live_replica", f"{where} {why}", (s, death.replica))
                    return
            await asyncio.sleep(NO_REPLICA_POLL_S)
        inputs: list[RawStreamMsg] = []
        if self.ctx.pipeline.takes_start(s):  # a later stage's input is read once its upstream holds it
            inputs = await self._stored_inputs(s, death.replica, seen.request_id)
            if not inputs:  # the replica had handled its input: the stage's own events end it
                log.info(
                    "request %s: no stored input of stage %d replica %d; nothing to move",
                    seen.request_id,
                    s,
                    death.replica,
                )
                return
        decision: Move | NoMove | None = None

        def change(rec: RequestRecord) -> bool:
            nonlocal decision  # as of the last try: a retried compare-and-set calls this again
            decision = plan_move(rec, s, death.replica, target, death.reason.value, stage.migration_limit)
            if isinstance(decision, Move):
                apply_move(rec, decision, time.time_ns(), self.instance_id)
            return isinstance(decision, Move)

        await update_record(self.ctx.requests, seen.request_id, change)
        if decision == NoMove.LIMIT:
            message = f"{where} died ({death.reason}); the request had moved {stage.migration_limit} time(s) in this stage already (migration_limit)"
            await self._fail(seen, "migration_limit", message)
        elif isinstance(decision, Move):
            await self._move(decision, seen, inputs, t0)

    async def unfinished_moves_loop(self) -> None:
        """Carry out again the moves whose orchestrator died after claiming them and before
        sending their input (:func:`unfinished_moves`)."""
        grace_ns = int(MOVE_TAKEOVER_S * 1e9)
        while True:
            await asyncio.sleep(MOVE_CHECK_PERIOD_S)
            now_ns = time.time_ns()
            found = [
                (move, rec, rec.stages[move.stage].attempts[-1].claimed_by)
                for rec in list(self._index.records.values())
                for move in unfinished_moves(rec, {self.instance_id}, now_ns, grace_ns)
            ]
            if not found:
                continue
            gone = {c for c in {c for *_, c in found} if c is not None and await self._claimer_gone(c)}
            live = {r.instance for r in self.services.live(ServiceKind.ORCHESTRATOR)} - gone
            for move, rec, claimer in found:
                if claimer in live or move.request_id in self._moving:
                    continue
                await self._exclusively(move.request_id, self._take_over(move, rec), "taking over its move")

    async def _claimer_gone(self, instance: str) -> bool:
        """Whether orchestrator ``instance``'s connection is gone (NATS: "no responders")."""
        try:
            await self.ctx.nc.request(
                self.ctx.subjects.orchestrator_alive(instance), b"", timeout=CLAIMER_PROBE_TIMEOUT_S
            )
        except NoRespondersError:
            return True
        except NatsTimeoutError:  # stopped, or slow: the registry decides
            pass
        return False

    async def _take_over(self, move: Move, seen: RequestRecord) -> None:
        """Claim ``move`` (its claimer died) and carry it out: every step of :meth:`_move` can be
        done twice (a re-sent input has the same ``Nats-Msg-Id`` and the stream drops it)."""
        t0 = time.monotonic()
        gone = seen.stages[move.stage].attempts[-1].claimed_by
        claimed = False

        def claim(rec: RequestRecord) -> bool:
            nonlocal claimed  # as of the last try: a retried compare-and-set calls this again
            last = rec.stages[move.stage].attempts[-1]
            claimed = last.attempt == move.attempt and last.sent_ns is None and last.claimed_by == gone
            if claimed:
                last.claimed_by = self.instance_id
            return claimed

        await update_record(self.ctx.requests, move.request_id, claim)
        if not claimed:
            return
        log.warning(
            "request %s: orchestrator %s died while moving stage %d to replica %d (attempt %d); carrying the move out",
            move.request_id,
            gone,
            move.stage,
            move.to_replica,
            move.attempt,
        )
        inputs: list[RawStreamMsg] = []
        if self.ctx.pipeline.takes_start(move.stage):
            inputs = await self._stored_inputs(move.stage, move.from_replica, move.request_id)
            if not inputs:  # sent and deleted: only the record's note was missing
                await self._note_sent(move)
                return
        await self._move(move, seen, inputs, t0)

    async def _move(self, move: Move, seen: RequestRecord, inputs: list[RawStreamMsg], t0: float) -> None:
        """Carry out ``move`` (docs/reliability.md, "How a thinker request moves" and after): fence
        the old attempt off, learn where the client's stream stands, send the new attempt its
        input, drop the stored originals. ``t0``: the verdict, ``time.monotonic()``."""
        rid, s = move.request_id, move.stage
        t_claimed = time.monotonic()
        notice = AbortNotice(request_id=rid, reason=MOVED, stage=s, attempt=move.attempt)
        await self.ctx.nc.publish(self.ctx.subjects.abort, notice.encode())
        query = ResumeQuery(request_id=rid, stage=s, attempt=move.attempt, replica=move.to_replica)
        try:  # asked again after a timeout: the gateway's fence only rises, its answer holds
            reply = await self._ask(self.ctx.subjects.resume(seen.gateway_id), query, "question")
        except (NatsTimeoutError, NoRespondersError) as e:
            message = f"the request's gateway did not answer ({type(e).__name__})"
            await self._fail(seen, "replica_lost", message)
            return
        point = decode(ResumePoint, reply.data)
        if not point.known:
            log.info("request %s: its gateway no longer holds it; not moved", rid)
            return
        t_asked = time.monotonic()
        held = ResumePoint(known=False)
        # The stage a request entered at has no upstream worker: its input is all in the stream.
        upstream = self.ctx.subjects.route(s - 1, seen.route[s - 1]) if s > seen.entry_stage else None
        if upstream is not None:  # asked the same question, it sends no chunk to the dead replica
            held = await self._reroute(upstream, query)
        if s > 0:
            inputs = await self._stored_inputs(s, move.from_replica, rid)
        start = min((decode(StageTask, m.data).seq for m in inputs), default=held.next_seq)
        resumed = sum(len(d.token_ids) for d in point.deltas)
        phase = Phase.IN_PROGRESS if resumed or point.audio_seq is not None else move.phase
        await self._send_moved(move, seen, inputs, point, start, phase, resumed)
        t_sent = time.monotonic()
        for msg in inputs:
            with contextlib.suppress(Exception):
                await self.ctx.js.delete_msg(self.ctx.subjects.stages_stream, msg.seq)
        if upstream is not None and held.known:
            release = notice.replace(replica=move.to_replica, start_seq=start)
            await self._reroute(upstream, release)
        with contextlib.suppress(Exception):
            await self._note_sent(
                move, phase=phase.value, resumed_tokens=resumed, start_seq=start if s > 0 else 0
            )
        steps_ms = [(b - a) * 1e3 for a, b in ((t0, t_claimed), (t_claimed, t_asked), (t_asked, t_sent))]
        _report(move, phase, resumed, point, len(inputs), start, steps_ms)
        labels = (str(s), str(move.from_replica), str(move.to_replica), move.reason, phase.value)
        self.ctx.count("vllm:omni_requests_migrated", *labels)

    async def _send_moved(
        self,
        move: Move,
        seen: RequestRecord,
        inputs: list[RawStreamMsg],
        point: ResumePoint,
        start: int,
        phase: Phase,
        resumed: int,
    ) -> None:
        """Send the new attempt the stored ``inputs``, resumed from ``point``, under an
        ``omni.migrate`` span: a child of the request's trace, linked to the attempt that died."""
        parent = context_from_headers(inputs[0].headers) if inputs else None
        link = Link(trace.get_current_span(parent).get_span_context(), {"omnirelay.link": "moved_from"})
        names = ("request_id", "stage", "from_replica", "to_replica", "attempt")
        attributes = {f"omnirelay.{name}": getattr(move, name) for name in names}
        links = [link] if parent is not None else None
        span = start_span("omni.migrate", parent, SpanKind.PRODUCER, attributes, links=links)
        event = {"reason": move.reason, "phase": phase.value, "resumed_tokens": resumed, "start_seq": start}
        span.add_event("request.moved", {f"omnirelay.{key}": value for key, value in event.items()})
        try:
            for msg in inputs:
                hdr = msg.headers or {}
                sender = [hdr.get(key, h.FROM_ORCHESTRATOR) for key in (h.FROM_STAGE, h.FROM_REPLICA)]
                hop = Hop(*sender, move.stage, move.to_replica)
                moved = _moved_task(decode(StageTask, msg.data), move, start, point, seen)
                await publish_task(self.ctx.js, self.ctx.subjects, moved, hop, span)
        finally:
            span.end()

    async def _stored_inputs(self, stage: int, replica: int, request_id: str) -> list[RawStreamMsg]:
        """The request's inputs still stored for replica ``replica`` of ``stage`` (unacknowledged)."""
        subject = self.ctx.subjects.stage_in(stage, replica)
        return await stored_inputs(self.ctx.js, self.ctx.subjects.stages_stream, subject, request_id)

    async def _note_sent(self, move: Move, **fields: object) -> None:
        """Note in ``move``'s attempt that it was sent (its takeover then stops), and ``fields``."""

        def note(rec: RequestRecord) -> bool:
            attempts = rec.stages[move.stage].attempts
            if not attempts or attempts[-1].attempt != move.attempt:
                return False
            for name, value in {**fields, "sent_ns": time.time_ns()}.items():
                setattr(attempts[-1], name, value)
            return True

        await update_record(self.ctx.requests, move.request_id, note)

    async def _ask(self, subject: str, question: RouteNotice, what: str) -> Msg:
        """The answer to ``question`` on ``subject``, asked up to ``REROUTE_TRIES`` times while it
        goes unanswered; raises ``NoRespondersError``, or ``NatsTimeoutError`` after the last try."""
        for _ in range(REROUTE_TRIES - 1):
            try:
                return await self.ctx.nc.request(subject, question.encode(), timeout=RESUME_TIMEOUT_S)
            except NatsTimeoutError:
                rid = question.request_id
                log.info("request %s: no answer to the move's %s on %s; asking again", rid, what, subject)
        return await self.ctx.nc.request(subject, question.encode(), timeout=RESUME_TIMEOUT_S)

    async def _reroute(self, subject: str, change: RouteNotice) -> ResumePoint:
        """Have the upstream worker hold the request's chunks (the move's question) or release
        them (its moved notice); not held when it no longer works on the request or is gone."""
        try:
            reply = await self._ask(subject, change, "hold" if isinstance(change, ResumeQuery) else "release")
        except (NoRespondersError, NatsTimeoutError):
            return ResumePoint(known=False)
        return decode(ResumePoint, reply.data)

    async def _fail(
        self, seen: RequestRecord, code: str, message: str, bound: tuple[int, int] | None = None
    ) -> None:
        """Fail a request now (503 ``code``) unless it has ended or, with ``bound`` (stage,
        replica), that stage no longer runs there: mark its record, abort it everywhere and answer
        the client."""
        failed = False

        def change(rec: RequestRecord) -> bool:
            nonlocal failed  # as of the last try: a retried compare-and-set calls this again
            failed = not rec.status.terminal and (bound is None or still_bound(rec, *bound))
            if failed:
                rec.status, rec.error, rec.updated_ns = RequestStatus.FAILED, code, time.time_ns()
            return failed

        await update_record(self.ctx.requests, seen.request_id, change)
        if not failed:
            return
        self._index.forget(seen.request_id)
        log.warning("request %s failed: %s", seen.request_id, message)
        await self.ctx.end_everywhere(seen, 503, code, message)


def _report(
    move: Move, phase: Phase, resumed: int, point: ResumePoint, inputs: int, start: int, steps_ms: list[float]
) -> None:
    """Log a move carried out; ``steps_ms``: verdict → claimed → gateway answered → inputs sent, ms."""
    log.warning(
        "request %s moved: stage %d replica %d -> %d (attempt %d, %s, %s; the client had %d token(s), "
        "audio up to chunk %s; %d stored input(s) re-sent from seq %d); sent %.0f ms after the verdict "
        "(claimed %.0f, gateway %.0f, inputs %.0f)",
        move.request_id,
        move.stage,
        move.from_replica,
        move.to_replica,
        move.attempt,
        move.reason,
        phase.value,
        resumed,
        point.audio_seq,
        inputs,
        start,
        sum(steps_ms),
        *steps_ms,
    )


def _moved_task(
    task: StageTask, move: Move, start_seq: int, point: ResumePoint, seen: RequestRecord
) -> StageTask:
    """The stored ``task`` of the attempt that died, as input of ``move``'s new attempt, routed as
    the record binds the later stages now; a start task goes on after the client's text deltas, a
    chunk is taken from ``start_seq`` on and carries no codes whose audio the client has."""
    s = move.stage
    route = [*task.route[:s], move.to_replica, *seen.route[s + 1 :]]
    update: dict[str, object] = {"route": route, "attempt": move.attempt, "moved": True}
    if s + 1 < len(seen.stages) and seen.stages[s + 1].attempts:
        current = seen.stages[s + 1].attempts[-1]
        update["next_attempt"], update["next_start_seq"] = current.attempt, current.start_seq
    if task.kind == TaskKind.START:
        update["resume"] = point.deltas
    else:
        update["start_seq"] = start_seq
        if point.audio_seq is not None and task.seq <= point.audio_seq:
            update["codes"] = None
    return task.replace(**update)
