"""Moving requests off dead replicas: the sequence that drives the bus (the decisions on the
record are :mod:`~services.orchestrator.migration`'s pure functions).

A request bound to a replica judged dead (:mod:`~services.orchestrator.liveness`) moves to a
live replica of the stage as the stage's next attempt, or fails now; a move whose claimer died before carrying it out is taken over
by another orchestrator (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

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
"""How long a move waits for the request's gateway to say where the client's stream stands, seconds."""
REROUTE_TRIES = 3
"""How many times a move asks an upstream worker to hold or release a request's chunks, or the
gateway where the client's stream stands, before it takes the silence for a death: a process
starved of its core for seconds misses one question, not three."""
MOVE_CHECK_PERIOD_S = 0.5
"""How often an orchestrator looks for moves whose claimer died before carrying them out, seconds."""
MOVE_TAKEOVER_S = 0.5
"""A move claimed this long ago and not carried out is taken over once its claimer is gone: NATS
answers the claimer's probe (``ctl.alive.orchestrator.<instance>``) with "no responders" (its
connection is gone), or its registration has expired (a claimer stopped or cut off from the
broker answers nothing), seconds (a move takes well under a second)."""
CLAIMER_PROBE_TIMEOUT_S = 0.5
"""How long a probe of a claimer waits for its answer, seconds."""


class Mover:
    """What one orchestrator does about dead replicas: counts its own verdicts, moves or fails the
    requests bound to them and takes over moves whose claimer died."""

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
        if self.ctx.metrics.enabled:
            self.ctx.metrics["vllm:omni_replica_evictions"].labels(
                self.ctx.model, str(death.stage), str(death.replica), death.reason.value
            ).inc()

    async def replica_died(self, death: Death, seen: RequestRecord) -> None:
        """A request bound to a dead replica, queued there or in progress: it moves to a live
        replica of the stage (:meth:`_move`), or fails now — ``no_live_replica`` when the stage
        has none for its ``no_replica_wait_s``, ``migration_limit`` past its ``migration_limit``
        — never by waiting for its deadline or for the replica's restart (docs/reliability.md)."""
        rid = seen.request_id
        if rid in self._moving:  # the watch hands it over again every probe period meanwhile
            return
        self._moving.add(rid)
        try:
            await self._move_or_fail(death, seen)
        finally:
            self._moving.discard(rid)

    async def _move_or_fail(self, death: Death, seen: RequestRecord) -> None:
        t0 = time.monotonic()
        s, stage = death.stage, self.ctx.pipeline.stages[death.stage]
        where = f"stage {s} ({stage.name}) replica {death.replica}"
        target = await self._live_replica(death, stage.no_replica_wait_s)
        if target is None:
            message = (
                f"{where} died ({death.reason}) and the stage has no live replica to move the request to"
            )
            await self._fail(seen, "no_live_replica", message, (s, death.replica))
            return
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
            if not isinstance(decision, Move):
                return False
            apply_move(rec, decision, time.time_ns(), self.instance_id)
            return True

        await update_record(self.ctx.requests, seen.request_id, change)
        if decision == NoMove.LIMIT:
            message = f"{where} died ({death.reason}); the request had moved {stage.migration_limit} time(s) in this stage already (migration_limit)"
            await self._fail(seen, "migration_limit", message)
        elif isinstance(decision, Move):
            await self._move(decision, seen, inputs, t0)

    async def unfinished_moves_loop(self) -> None:
        """Carry out again the moves whose orchestrator died after claiming them and before
        sending their input (:func:`unfinished_moves`): without this such a request would wait
        for its deadline."""
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
                self._moving.add(move.request_id)
                try:
                    await self._take_over(move, rec)
                except Exception as e:
                    log.warning("request %s: taking over its move failed: %s", move.request_id, e)
                finally:
                    self._moving.discard(move.request_id)

    async def _claimer_gone(self, instance: str) -> bool:
        """Whether orchestrator ``instance``'s connection is gone (NATS: "no responders")."""
        try:
            await self.ctx.nc.request(
                self.ctx.subjects.orchestrator_alive(instance), b"", timeout=CLAIMER_PROBE_TIMEOUT_S
            )
        except NoRespondersError:
            return True
        except NatsTimeoutError:  # stopped, or slow: the registry decides
            return False
        return False

    async def _take_over(self, move: Move, seen: RequestRecord) -> None:
        """Claim ``move`` (its claimer died) and carry it out: every step of :meth:`_move` can be
        done twice (the abort notice, the gateway's fence, hold and release; a re-sent input has
        the same ``Nats-Msg-Id`` and the stream drops it)."""
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

                def sent(rec: RequestRecord) -> bool:
                    last = rec.stages[move.stage].attempts[-1]
                    if last.attempt != move.attempt:
                        return False
                    last.sent_ns = time.time_ns()
                    return True

                await update_record(self.ctx.requests, move.request_id, sent)
                return
        await self._move(move, seen, inputs, t0)

    async def _live_replica(self, death: Death, wait_s: float) -> int | None:
        """A live replica of the dead one's stage (the least loaded), waiting up to ``wait_s`` for
        one to appear; None when none did."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.ctx.picker.pick(death.stage)
            except NoLiveReplica:
                if time.monotonic() >= deadline:
                    return None
            await asyncio.sleep(NO_REPLICA_POLL_S)

    async def _move(self, move: Move, seen: RequestRecord, inputs: list[RawStreamMsg], t0: float) -> None:
        """Carry out ``move``: fence the old attempt off (its worker and the client's stream),
        learn where the client's stream stands, and send the new attempt its input — a listener or thinker
        the stored task going on after what the client has; a later stage the chunks the dead replica
        had not acknowledged, its upstream holding the request's chunks meanwhile — then drop the
        stored originals. Every step can be done twice (:meth:`_take_over`)."""
        rid, s = move.request_id, move.stage
        t_claimed = time.monotonic()
        notice = AbortNotice(request_id=rid, reason=MOVED, stage=s, attempt=move.attempt)
        await self.ctx.nc.publish(self.ctx.subjects.abort, notice.encode())
        query = ResumeQuery(request_id=rid, stage=s, attempt=move.attempt, replica=move.to_replica)
        point = await self._ask_gateway(seen, query)
        if point is None:
            return
        t_asked = time.monotonic()
        held = ResumePoint(known=False)
        # The stage a request entered at has no upstream worker: its input is all in the stream.
        upstream = self.ctx.subjects.route(s - 1, seen.route[s - 1]) if s > seen.entry_stage else None
        if upstream is not None:  # asked the same question, it sends no chunk to the dead replica
            held = await self._reroute(upstream, query)
        if s > 0:
            inputs = await self._stored_inputs(s, move.from_replica, rid)
        tasks = [decode(StageTask, m.data) for m in inputs]
        start = min((t.seq for t in tasks), default=held.next_seq)
        resumed = sum(len(d.token_ids) for d in point.deltas)
        phase = Phase.IN_PROGRESS if resumed or point.audio_seq is not None else move.phase
        await self._send_inputs(move, seen, inputs, tasks, point, start, phase)
        t_sent = time.monotonic()
        for msg in inputs:
            with contextlib.suppress(Exception):
                await self.ctx.js.delete_msg(self.ctx.subjects.stages_stream, msg.seq)
        if upstream is not None and held.known:
            release = notice.replace(replica=move.to_replica, start_seq=start)
            await self._reroute(upstream, release)
        await self._note_sent(move, phase, resumed, start)
        steps_ms = [
            (t1 - t0_) * 1e3 for t0_, t1 in ((t0, t_claimed), (t_claimed, t_asked), (t_asked, t_sent))
        ]
        self._report(move, phase, point, len(inputs), start, steps_ms)

    def _report(
        self, move: Move, phase: Phase, point: ResumePoint, inputs: int, start: int, steps_ms: list[float]
    ) -> None:
        """Log and count a move carried out; ``steps_ms``: verdict → claimed → the gateway's answer
        → inputs sent, milliseconds."""
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
            sum(len(d.token_ids) for d in point.deltas),
            point.audio_seq,
            inputs,
            start,
            sum(steps_ms),
            *steps_ms,
        )
        if self.ctx.metrics.enabled:
            labels = (str(move.stage), str(move.from_replica), str(move.to_replica), move.reason, phase.value)
            self.ctx.metrics["vllm:omni_requests_migrated"].labels(self.ctx.model, *labels).inc()

    async def _stored_inputs(self, stage: int, replica: int, request_id: str) -> list[RawStreamMsg]:
        """The request's inputs still stored for replica ``replica`` of ``stage`` (unacknowledged)."""
        subject = self.ctx.subjects.stage_in(stage, replica)
        return await stored_inputs(self.ctx.js, self.ctx.subjects.stages_stream, subject, request_id)

    async def _send_inputs(
        self,
        move: Move,
        seen: RequestRecord,
        inputs: list[RawStreamMsg],
        tasks: list[StageTask],
        point: ResumePoint,
        start: int,
        phase: Phase,
    ) -> None:
        """Send the stored ``inputs`` to the new attempt (:func:`_moved_task`) under an
        ``omni.migrate`` span: a child of the request's trace, linked to the attempt that died."""
        parent = context_from_headers(inputs[0].headers) if inputs else None
        link = Link(trace.get_current_span(parent).get_span_context(), {"omnirelay.link": "moved_from"})
        attributes = {
            "omnirelay.request_id": move.request_id,
            "omnirelay.stage": move.stage,
            "omnirelay.from_replica": move.from_replica,
            "omnirelay.to_replica": move.to_replica,
            "omnirelay.attempt": move.attempt,
        }
        span = start_span(
            "omni.migrate",
            parent,
            SpanKind.PRODUCER,
            attributes,
            links=[link] if parent is not None else None,
        )
        span.add_event(
            "request.moved",
            {
                "omnirelay.reason": move.reason,
                "omnirelay.phase": phase.value,
                "omnirelay.resumed_tokens": sum(len(d.token_ids) for d in point.deltas),
                "omnirelay.start_seq": start,
            },
        )
        try:
            for msg, task in zip(inputs, tasks, strict=True):
                hdr = msg.headers or {}
                sender = (
                    hdr.get(h.FROM_STAGE, h.FROM_ORCHESTRATOR),
                    hdr.get(h.FROM_REPLICA, h.FROM_ORCHESTRATOR),
                )
                hop = Hop(*sender, move.stage, move.to_replica)
                await publish_task(
                    self.ctx.js, self.ctx.subjects, _moved_task(task, move, start, point, seen), hop, span
                )
        finally:
            span.end()

    async def _note_sent(self, move: Move, phase: Phase, resumed: int, start: int) -> None:
        """Write into the record that ``move`` was carried out (its takeover then stops)."""

        def note(rec: RequestRecord) -> bool:
            attempts = rec.stages[move.stage].attempts
            if not attempts or attempts[-1].attempt != move.attempt:
                return False
            attempts[-1].phase, attempts[-1].resumed_tokens = phase.value, resumed
            attempts[-1].start_seq = start if move.stage > 0 else 0
            attempts[-1].sent_ns = time.time_ns()
            return True

        with contextlib.suppress(Exception):
            await update_record(self.ctx.requests, move.request_id, note)

    async def _ask_gateway(self, seen: RequestRecord, query: ResumeQuery) -> ResumePoint | None:
        """Where the client's stream of the moving stage stands (the question fences the older
        attempts off); None when nothing is to be moved: the gateway no longer holds the request,
        or it did not answer (the request is failed then)."""
        for tries_left in reversed(range(REROUTE_TRIES)):
            try:  # asked again after a timeout: the gateway's fence only rises, its answer holds
                reply = await self.ctx.nc.request(
                    self.ctx.subjects.resume(seen.gateway_id), query.encode(), timeout=RESUME_TIMEOUT_S
                )
                break
            except NatsTimeoutError as e:
                if tries_left:
                    log.info(
                        "request %s: its gateway did not say where the stream stands; asking again",
                        query.request_id,
                    )
                    continue
                error: Exception = e
            except NoRespondersError as e:
                error = e
            await self._fail(
                seen, "replica_lost", f"the request's gateway did not answer ({type(error).__name__})"
            )
            return None
        point = decode(ResumePoint, reply.data)
        if not point.known:
            log.info("request %s: its gateway no longer holds it; not moved", query.request_id)
            return None
        return point

    async def _reroute(self, subject: str, change: RouteNotice) -> ResumePoint:
        """Have the upstream worker hold the request's chunks (the move's question) or release
        them (its moved notice); not held when it no longer works on the request, or nobody takes
        the question (it died too). A question that goes unanswered is asked again
        (``REROUTE_TRIES`` in all): a live worker that did not hear it would go on sending to the
        dead replica, or hold the chunks for good."""
        for tries_left in reversed(range(REROUTE_TRIES)):
            try:
                reply = await self.ctx.nc.request(subject, change.encode(), timeout=RESUME_TIMEOUT_S)
            except NoRespondersError:
                return ResumePoint(known=False)
            except NatsTimeoutError:
                if not tries_left:
                    return ResumePoint(known=False)
                log.info(
                    "request %s: no answer to the move's %s on %s; asking again",
                    change.request_id,
                    "hold" if isinstance(change, ResumeQuery) else "release",
                    subject,
                )
                continue
            return decode(ResumePoint, reply.data)
        raise AssertionError("not reached")

    async def _fail(
        self, seen: RequestRecord, code: str, message: str, bound: tuple[int, int] | None = None
    ) -> None:
        """Fail a request now (503 ``code``) unless it has ended meanwhile or another orchestrator
        failed it — or, with ``bound`` (stage, replica), unless that stage no longer runs on that
        replica (it moved meanwhile, :func:`still_bound`): mark its record, abort it everywhere
        and answer the client."""
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


def _moved_task(
    task: StageTask, move: Move, start_seq: int, point: ResumePoint, seen: RequestRecord
) -> StageTask:
    """The stored ``task`` of the attempt that died, as input of ``move``'s new attempt: bound to
    the new replica and, for the stages after it, to where the record binds them now (the stored
    task has the route of when it was sent; a later stage may have moved since), sending to the
    next stage's current attempt; a start task goes on after the client's text deltas, a later
    stage's takes chunks from ``start_seq`` and carries no audio the client already has."""
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
