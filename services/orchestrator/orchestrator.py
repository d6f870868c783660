"""The orchestrator: admits requests, binds replicas, dispatches stage 0, follows the lifecycle.

Stateless: every instance pulls from the same two durable consumers (admissions, lifecycle
events) and keeps all request state in the ``omni_requests`` KV bucket, so any number of
instances can run and any of them may die.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import RawStreamMsg
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from libs.common import headers as h
from libs.common.bus import (
    connect,
    consume,
    ensure_topology,
    evictions_kv,
    orchestrator_consumer_config,
    requests_kv,
    services_kv,
)
from libs.common.consumer import Handler, PullConsumer
from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    Admission,
    ClientEvent,
    ClientEventType,
    LifecycleEvent,
    MalformedMessage,
    ResumePoint,
    ResumeQuery,
    Resync,
    RouteChange,
    RouteHeld,
    StageEnded,
    StageTask,
    TaskKind,
    decode,
    decode_or_log,
)
from libs.common.jetstream import JetStream
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.metrics_server import start_metrics_server
from libs.common.pipeline import PipelineConfig
from libs.common.publish import Hop, publish_client, publish_task
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from libs.common.registry import Heartbeat, LiveServices, ServiceKind, ServiceRecord
from libs.common.runtime import freeze_startup_heap
from libs.common.settings import OrchestratorSettings
from libs.common.subjects import (
    ORCHESTRATOR_ADMISSION_CONSUMER,
    ORCHESTRATOR_EVENTS_CONSUMER,
    ORCHESTRATOR_QUEUE,
    Subjects,
)
from libs.common.tracing import context_from_headers, setup_tracing, shutdown_tracing, start_span
from libs.common.version import VERSION
from services.orchestrator.deadlines import DeadlineSweeper
from services.orchestrator.inflight import InflightRequests
from services.orchestrator.liveness import Death, DeathReason, ReplicaWatch
from services.orchestrator.migration import (
    Move,
    NoMove,
    Phase,
    apply_move,
    plan_move,
    stored_inputs,
    unfinished_moves,
)
from services.orchestrator.routing import NoLiveReplica, ReplicaPicker
from services.orchestrator.summary import PipelineTally, format_summary, ready_to_summarize

log = logging.getLogger(__name__)

KV_RETRIES = 5
UNKNOWN_EVENT_TRIES = 3
"""Deliveries of a lifecycle event whose request has no record before it is dropped."""
UNKNOWN_EVENT_RETRY_S = 0.2
"""Redelivery delay of such an event, seconds."""
MAX_CONCURRENT_ADMISSIONS = 64
"""Admissions one orchestrator works on at once."""
EVENT_DEFER_S = 0.01
"""A lifecycle event waits this long before its record update, seconds: bookkeeping then runs
beside the engine's work instead of beside the next request's admission and dispatch (measured
with ``omnirelay bench`` at c=1: TTFT p50 -0.4 ms; c=16 throughput +4 %)."""
RECORD_DEFER_S = 0.005
"""The request record is written this long after stage 0's task is sent, seconds: the broker,
the worker and its engine take the task first on a busy front-end core (A/B at c=1, 400 requests
a side: TTFT p50 -0.2 to -0.5 ms together with the gateway's stream start on ``started``)."""
MAX_CONCURRENT_EVENTS = 16
"""Lifecycle events one orchestrator works on at once (updates of one record are compare-and-set)."""
NO_REPLICA_POLL_S = 0.2
"""How often a request waiting for a live replica to move to looks again, seconds."""
RESUME_TIMEOUT_S = 2.0
"""How long a move waits for the request's gateway to say where the client's stream stands, seconds."""
MOVE_CHECK_PERIOD_S = 1.0
"""How often an orchestrator looks for moves whose claimer died before carrying them out, seconds."""
MOVE_TAKEOVER_S = 2.0
"""How long after its claim a move not carried out may be taken over (once its claimer has also
left the registry), seconds (a move takes well under a second)."""
HEALTH_PERIOD_S = 2.0
LOOP_LAG_PERIOD_S = 0.25


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, pipeline: PipelineConfig) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.subjects = Subjects(pipeline.name)
        self._tasks: list[asyncio.Task[None]] = []
        self._consumers: list[PullConsumer] = []
        self._inflight = 0
        self.metrics = MetricSet(Exporter.ORCHESTRATOR, settings.log_stats)
        self._tally = PipelineTally()
        self.model = pipeline.served_model_name
        self._moving: set[str] = set()
        """Requests this instance is moving or failing after their replica's death."""

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, "omnirelay-orchestrator")
        self.js = JetStream(self.nc)
        await ensure_topology(self.js, self.subjects)
        self.requests: KeyValue = await requests_kv(self.js)
        skv = await services_kv(self.js)
        self.services = LiveServices(skv, self.pipeline.name)
        self.picker = ReplicaPicker(self.services, lambda rec: self._watch.judged_dead(rec))
        await self.services.start()
        await asyncio.wait_for(self.services.ready.wait(), timeout=10)
        self._index = InflightRequests(self.requests, self.pipeline.name)
        await self._index.start()
        self._sweeper = DeadlineSweeper(self.requests, self._index, self._expired)
        await self._sweeper.start()
        self._watch = ReplicaWatch(
            self.nc,
            self.subjects,
            self.pipeline,
            self._index,
            self.services,
            await evictions_kv(self.js),
            self._evicted,
            self._replica_died,
        )
        await self._watch.start()
        await self.nc.subscribe(self.subjects.resync, queue=ORCHESTRATOR_QUEUE, cb=self._on_resync)
        self._tasks.append(asyncio.create_task(self._unfinished_moves_loop(), name="unfinished-moves"))
        port = start_metrics_server(self.settings.metrics_port)
        record = ServiceRecord(
            service=ServiceKind.ORCHESTRATOR,
            pipeline=self.pipeline.name,
            instance=self.settings.instance_id,
            metrics_url=f"http://{self.settings.advertise_host}:{port}/metrics",
            version=VERSION,
        )
        self._heartbeat = Heartbeat(skv, record, lambda: self._inflight)
        await self._heartbeat.start()
        if self.metrics.enabled:
            self._tasks += [
                asyncio.create_task(self._queue_depth_loop(), name="queue-depth"),
                asyncio.create_task(self._loop_lag_loop(), name="loop-lag"),
                asyncio.create_task(self._pipeline_log_loop(), name="pipeline-log"),
            ]
        limits = self.settings.bus_limits
        self._consumers = [
            await consume(
                self.nc,
                self.js,
                self.subjects.requests_stream,
                orchestrator_consumer_config(self.subjects.requests, ORCHESTRATOR_ADMISSION_CONSUMER, limits),
                self._concurrently(self._admit, MAX_CONCURRENT_ADMISSIONS),
                batch=MAX_CONCURRENT_ADMISSIONS,
                name="orchestrator admissions",
            ),
            await consume(
                self.nc,
                self.js,
                self.subjects.events_stream,
                orchestrator_consumer_config(
                    self.subjects.events_wildcard, ORCHESTRATOR_EVENTS_CONSUMER, limits
                ),
                self._concurrently(self._on_event, MAX_CONCURRENT_EVENTS),
                batch=MAX_CONCURRENT_EVENTS,
                name="orchestrator events",
            ),
        ]
        log.info("orchestrator %s: ready, metrics on :%d", self.settings.instance_id, port)

    async def _queue_depth_loop(self) -> None:
        """Admissions waiting in the requests stream, every few seconds."""
        gauge = self.metrics["vllm:omni_orchestrator_admission_queue_depth"].labels(self.model)
        while True:
            try:
                ci = await self.js.consumer_info(
                    self.subjects.requests_stream, ORCHESTRATOR_ADMISSION_CONSUMER
                )
                gauge.set(ci.num_pending or 0)
            except Exception as e:
                log.debug("admission consumer info unavailable: %s", e)
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _loop_lag_loop(self) -> None:
        """How late the event loop wakes up against a fixed period (a busy or blocked loop)."""
        hist = self.metrics["vllm:omni_orchestrator_loop_lag_s"].labels(self.model)
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            hist.observe(max(0.0, time.monotonic() - t0 - LOOP_LAG_PERIOD_S))

    async def _pipeline_log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.log_stats_interval_s)
            log.info(
                "%s",
                self._tally.line(self.pipeline.name, len(self._index), self.settings.log_stats_interval_s),
            )

    def _count(self, outcome: str) -> None:
        if self.metrics.enabled:
            self.metrics["vllm:omni_orchestrator_admissions"].labels(self.model, outcome).inc()

    async def stop(self) -> None:
        for c in self._consumers:
            await c.stop()
        for t in self._tasks:
            t.cancel()
        await self._watch.stop()
        await self._sweeper.stop()
        await self._index.stop()
        await self._heartbeat.stop()
        await self.services.stop()
        with contextlib.suppress(Exception):
            await self.nc.drain()

    def _concurrently(self, handle: Handler, concurrency: int) -> Handler:
        """A message handler that runs ``handle`` on up to ``concurrency`` messages at once
        (it waits for a free slot before taking the next message)."""
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task[None]] = set()

        async def start(msg: Msg) -> None:
            await slots.acquire()
            task = asyncio.create_task(self._handle(msg, handle))
            running.add(task)
            task.add_done_callback(running.discard)
            task.add_done_callback(lambda _: slots.release())

        return start

    @staticmethod
    async def _handle(msg: Msg, handle) -> None:
        try:
            await handle(msg)
        except MalformedMessage as e:
            log.error("terminating malformed message on %s: %s", msg.subject, e)
            with contextlib.suppress(Exception):
                await msg.term()
        except Exception:
            log.exception("handling %s failed; it will be redelivered", msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    # --- admission -----------------------------------------------------------------------
    async def _admit(self, msg: Msg) -> None:
        adm = decode(Admission, msg.data)
        now = time.time_ns()
        if now >= adm.deadline_ns:
            await self._reject(adm, 504, "timeout", "request expired while waiting for admission")
            await msg.ack()
            self._count("expired")
            return
        stages = self.pipeline.stages_for(adm.audio)
        try:
            route = self.picker.route(stages)
        except NoLiveReplica as e:
            name = self.pipeline.stages[e.stage].name
            message = f"stage {e.stage} ({name}) has no live replica"
            await self._reject(adm, 503, "no_live_replica", message, e.why())
            await msg.ack()
            self._count("no_live_replica")
            return
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        record = RequestRecord(
            request_id=adm.request_id,
            pipeline=self.pipeline.name,
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
                publish_task(self.js, self.subjects, task, hop, span),
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
        await self.requests.put(record.request_id, record.model_dump_json().encode())

    async def _reject(self, adm: Admission, status: int, code: str, message: str, detail: str = "") -> None:
        """Answer the client with ``message``; the log line adds ``detail`` (for the operator)."""
        log.warning("request %s rejected: %s%s", adm.request_id, message, f"; {detail}" if detail else "")
        await self._tell_client(adm.request_id, adm.gateway_id, status, code, message)

    async def _tell_client(
        self, request_id: str, gateway_id: str, status: int, code: str, message: str
    ) -> None:
        event = ClientEvent(
            request_id=request_id, type=ClientEventType.ERROR, status=status, code=code, message=message
        )
        await publish_client(self.nc, self.subjects, gateway_id, event)

    async def _end_everywhere(self, rec: RequestRecord, status: int, code: str, message: str) -> None:
        """A request this instance has just failed: abort it in every worker (reason ``code``)
        and answer the client."""
        await self.nc.publish(
            self.subjects.abort, AbortNotice(request_id=rec.request_id, reason=code).encode()
        )
        await self._tell_client(rec.request_id, rec.gateway_id, status, code, message)

    async def _expired(self, rec: RequestRecord) -> None:
        """A request past its deadline: abort it in every worker and answer the client."""
        await self._end_everywhere(rec, 504, "timeout", "the request did not finish before its deadline")

    # --- dead replicas -----------------------------------------------------------------
    def _evicted(self, death: Death) -> None:
        """This instance was the first to judge ``death``: count it and tell the operator."""
        stage = self.pipeline.stages[death.stage]
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
        if self.metrics.enabled:
            self.metrics["vllm:omni_replica_evictions"].labels(
                self.model, str(death.stage), str(death.replica), death.reason.value
            ).inc()

    async def _replica_died(self, death: Death, seen: RequestRecord) -> None:
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
        s, stage = death.stage, self.pipeline.stages[death.stage]
        where = f"stage {s} ({stage.name}) replica {death.replica}"
        target = await self._live_replica(death, stage.no_replica_wait_s)
        if target is None:
            message = (
                f"{where} died ({death.reason}) and the stage has no live replica to move the request to"
            )
            await self._fail(seen, "no_live_replica", message)
            return
        inputs: list[RawStreamMsg] = []
        if s == 0:  # a later stage's input is read once its upstream holds it (_move)
            subject = self.subjects.stage_in(s, death.replica)
            inputs = await stored_inputs(self.js, self.subjects.stages_stream, subject, seen.request_id)
            if not inputs:  # the replica had handled its input: the stage's own events end it
                log.info("request %s: no stored input on %s; nothing to move", seen.request_id, subject)
                return
        decision: Move | NoMove | None = None

        def change(rec: RequestRecord) -> bool:
            nonlocal decision  # as of the last try: a retried compare-and-set calls this again
            decision = plan_move(rec, s, death.replica, target, death.reason.value, stage.migration_limit)
            if not isinstance(decision, Move):
                return False
            apply_move(rec, decision, time.time_ns(), self.settings.instance_id)
            return True

        await update_record(self.requests, seen.request_id, change)
        if decision == NoMove.LIMIT:
            message = f"{where} died ({death.reason}); the request had moved {stage.migration_limit} time(s) in this stage already (migration_limit)"
            await self._fail(seen, "migration_limit", message)
        elif isinstance(decision, Move):
            await self._move(decision, seen, inputs, t0)

    async def _unfinished_moves_loop(self) -> None:
        """Carry out again the moves whose orchestrator died after claiming them and before
        sending their input (:func:`unfinished_moves`): without this such a request would wait
        for its deadline."""
        while True:
            await asyncio.sleep(MOVE_CHECK_PERIOD_S)
            live = {r.instance for r in self.services.live(ServiceKind.ORCHESTRATOR)}
            live.add(self.settings.instance_id)
            now_ns = time.time_ns()
            for rec in list(self._index.records.values()):
                for move in unfinished_moves(rec, live, now_ns, int(MOVE_TAKEOVER_S * 1e9)):
                    if move.request_id in self._moving:
                        continue
                    self._moving.add(move.request_id)
                    try:
                        await self._take_over(move, rec)
                    except Exception as e:
                        log.warning("request %s: taking over its move failed: %s", move.request_id, e)
                    finally:
                        self._moving.discard(move.request_id)

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
                last.claimed_by = self.settings.instance_id
            return claimed

        await update_record(self.requests, move.request_id, claim)
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
        if move.stage == 0:
            subject = self.subjects.stage_in(0, move.from_replica)
            inputs = await stored_inputs(self.js, self.subjects.stages_stream, subject, move.request_id)
            if not inputs:  # sent and deleted: only the record's note was missing

                def sent(rec: RequestRecord) -> bool:
                    last = rec.stages[0].attempts[-1]
                    if last.attempt != move.attempt:
                        return False
                    last.sent_ns = time.time_ns()
                    return True

                await update_record(self.requests, move.request_id, sent)
                return
        await self._move(move, seen, inputs, t0)

    async def _live_replica(self, death: Death, wait_s: float) -> int | None:
        """A live replica of the dead one's stage (the least loaded), waiting up to ``wait_s`` for
        one to appear; None when none did."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.picker.pick(death.stage)
            except NoLiveReplica:
                if time.monotonic() >= deadline:
                    return None
            await asyncio.sleep(NO_REPLICA_POLL_S)

    async def _move(self, move: Move, seen: RequestRecord, inputs: list[RawStreamMsg], t0: float) -> None:
        """Carry out ``move``: fence the old attempt off (its worker and the client's stream),
        learn where the client's stream stands, and send the new attempt its input — stage 0 the
        stored task going on after what the client has; a later stage the chunks the dead replica
        had not acknowledged, its upstream holding the request's chunks meanwhile — then drop the
        stored originals."""
        rid, s = move.request_id, move.stage
        t_claimed = time.monotonic()
        await self.nc.publish(
            self.subjects.abort,
            AbortNotice(request_id=rid, reason=MOVED, stage=s, attempt=move.attempt).encode(),
        )
        point = await self._ask_gateway(seen, move)
        if point is None:
            return
        t_asked = time.monotonic()
        held = RouteHeld(held=False)
        upstream = self.subjects.route(s - 1, seen.route[s - 1]) if s > 0 else None
        if upstream is not None:  # no chunk may go to the dead replica from now on
            held = await self._reroute(upstream, RouteChange(request_id=rid, stage=s, action="hold"))
            inputs = await stored_inputs(
                self.js, self.subjects.stages_stream, self.subjects.stage_in(s, move.from_replica), rid
            )
        tasks = [decode(StageTask, m.data) for m in inputs]
        start = min((t.seq for t in tasks), default=held.next_seq)
        resumed = sum(len(d.token_ids) for d in point.deltas)
        phase = Phase.IN_PROGRESS if resumed or point.audio_seq is not None else move.phase
        parent = context_from_headers(inputs[0].headers) if inputs else None
        span = start_span(
            "omni.migrate",
            parent,
            SpanKind.PRODUCER,
            {
                "omnirelay.request_id": rid,
                "omnirelay.stage": s,
                "omnirelay.from_replica": move.from_replica,
                "omnirelay.to_replica": move.to_replica,
                "omnirelay.attempt": move.attempt,
            },
            links=[Link(trace.get_current_span(parent).get_span_context(), {"omnirelay.link": "moved_from"})]
            if parent is not None
            else None,
        )
        span.add_event(
            "request.moved",
            {
                "omnirelay.reason": move.reason,
                "omnirelay.phase": phase.value,
                "omnirelay.resumed_tokens": resumed,
                "omnirelay.start_seq": start,
            },
        )
        try:
            for msg, task in zip(inputs, tasks, strict=True):
                moved = _moved_task(task, move, start, point, seen)
                hdr = msg.headers or {}
                hop = Hop(
                    hdr.get(h.FROM_STAGE, h.FROM_ORCHESTRATOR),
                    hdr.get(h.FROM_REPLICA, h.FROM_ORCHESTRATOR),
                    s,
                    move.to_replica,
                )
                await publish_task(self.js, self.subjects, moved, hop, span)
        finally:
            span.end()
        t_sent = time.monotonic()
        for msg in inputs:
            with contextlib.suppress(Exception):
                await self.js.delete_msg(self.subjects.stages_stream, msg.seq)
        if upstream is not None and held.held:
            release = RouteChange(
                request_id=rid,
                stage=s,
                action="release",
                replica=move.to_replica,
                attempt=move.attempt,
                start_seq=start,
            )
            await self._reroute(upstream, release)

        def note(rec: RequestRecord) -> bool:
            attempts = rec.stages[s].attempts
            if not attempts or attempts[-1].attempt != move.attempt:
                return False
            attempts[-1].phase, attempts[-1].resumed_tokens = phase.value, resumed
            attempts[-1].start_seq = start if s > 0 else 0
            attempts[-1].sent_ns = time.time_ns()
            return True

        with contextlib.suppress(Exception):
            await update_record(self.requests, rid, note)
        log.warning(
            "request %s moved: stage %d replica %d -> %d (attempt %d, %s, %s; the client had %d token(s), "
            "audio up to chunk %s; %d stored input(s) re-sent from seq %d); sent %.0f ms after the verdict "
            "(claimed %.0f, gateway %.0f, inputs %.0f)",
            rid,
            s,
            move.from_replica,
            move.to_replica,
            move.attempt,
            move.reason,
            phase.value,
            resumed,
            point.audio_seq,
            len(inputs),
            start,
            (t_sent - t0) * 1e3,
            (t_claimed - t0) * 1e3,
            (t_asked - t_claimed) * 1e3,
            (t_sent - t_asked) * 1e3,
        )
        if self.metrics.enabled:
            self.metrics["vllm:omni_requests_migrated"].labels(
                self.model, str(s), str(move.from_replica), str(move.to_replica), move.reason, phase.value
            ).inc()

    async def _ask_gateway(self, seen: RequestRecord, move: Move) -> ResumePoint | None:
        """Where the client's stream of the moving stage stands (the question fences the older
        attempts off); None when nothing is to be moved: the gateway no longer holds the request,
        or it did not answer (the request is failed then)."""
        query = ResumeQuery(request_id=move.request_id, stage=move.stage, attempt=move.attempt)
        try:
            reply = await self.nc.request(
                self.subjects.resume(seen.gateway_id), query.encode(), timeout=RESUME_TIMEOUT_S
            )
        except (NoRespondersError, NatsTimeoutError) as e:
            await self._fail(
                seen, "replica_lost", f"the request's gateway did not answer ({type(e).__name__})"
            )
            return None
        point = decode(ResumePoint, reply.data)
        if not point.known:
            log.info("request %s: its gateway no longer holds it; not moved", move.request_id)
            return None
        return point

    async def _reroute(self, subject: str, change: RouteChange) -> RouteHeld:
        """Ask the upstream worker to hold or release the request's chunks; not held when it no
        longer works on the request (or does not answer: it died too)."""
        try:
            reply = await self.nc.request(subject, change.encode(), timeout=RESUME_TIMEOUT_S)
        except (NoRespondersError, NatsTimeoutError):
            return RouteHeld(held=False)
        return decode(RouteHeld, reply.data)

    async def _fail(self, seen: RequestRecord, code: str, message: str) -> None:
        """Fail a request now (503 ``code``) unless it has ended meanwhile or another orchestrator
        failed it: mark its record, abort it everywhere and answer the client."""
        failed = False

        def change(rec: RequestRecord) -> bool:
            nonlocal failed  # as of the last try: a retried compare-and-set calls this again
            failed = not rec.status.terminal
            if failed:
                rec.status, rec.error, rec.updated_ns = RequestStatus.FAILED, code, time.time_ns()
            return failed

        await update_record(self.requests, seen.request_id, change)
        if not failed:
            return
        self._index.forget(seen.request_id)
        log.warning("request %s failed: %s", seen.request_id, message)
        await self._end_everywhere(seen, 503, code, message)

    async def _on_resync(self, msg: Msg) -> None:
        """A gateway lost events of a thinker attempt (a broker restart): the request goes on as
        a new attempt from what the client has, on the least loaded live replica (the same one
        may take it), exactly as if its replica had died."""
        if (ask := decode_or_log(Resync, msg.data, "resync", log)) is None:
            return
        await msg.respond(b"")  # taken: the gateway stops asking
        try:
            entry = await self.requests.get(ask.request_id)
        except (NotFoundError, KeyError):
            return
        rec = RequestRecord.model_validate_json(entry.value)
        if ask.stage != 0 or rec.status.terminal or rec.stages[0].attempt != ask.attempt:
            log.info(
                "request %s: resync of stage %d attempt %d not needed (record: %s, attempt %d)",
                ask.request_id,
                ask.stage,
                ask.attempt,
                rec.status.value,
                rec.stages[0].attempt,
            )
            return
        lost = Death(0, rec.route[0], 0, DeathReason.LOST_EVENTS, 0.0)
        await self._replica_died(lost, rec)

    # --- lifecycle ---------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        ev = decode(LifecycleEvent, msg.data)
        await asyncio.sleep(EVENT_DEFER_S)
        summary: list[RequestRecord] = []
        gateway: list[str] = []

        def change(rec: RequestRecord) -> None:
            apply_event(rec, ev)
            if self.settings.log_stats and ready_to_summarize(rec):
                rec.summary_logged = True
                summary[:] = [rec]
            gateway[:] = [rec.gateway_id] if ends_client_stream(rec, ev) else []

        if not await update_record(self.requests, ev.request_id, change):
            attempt = msg.metadata.num_delivered if msg.metadata else 1
            if attempt < UNKNOWN_EVENT_TRIES:  # its admission may still be writing the record
                await msg.nak(delay=UNKNOWN_EVENT_RETRY_S)
                return
            log.debug("event %s for unknown request %s dropped", ev.kind, ev.request_id)
        await msg.ack()
        for gateway_id in gateway:  # the gateway checks that the stream's last events came
            ended = StageEnded(
                request_id=ev.request_id,
                stage=ev.stage or 0,
                attempt=ev.attempt,
                replica=ev.replica or 0,
                client_events=ev.client_events or 0,
                finish_reason=ev.finish_reason,
                usage=ev.usage,
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.ended(gateway_id), ended.encode())
        for rec in summary:  # only the writer whose update stuck gets here
            log.info("%s", format_summary(rec, self.pipeline))
            self._tally.end(rec)


def _moved_task(
    task: StageTask, move: Move, start_seq: int, point: ResumePoint, seen: RequestRecord
) -> StageTask:
    """The stored ``task`` of the attempt that died, as input of ``move``'s new attempt: bound to
    the new replica and, for the stages after it, to where the record binds them now (the stored
    task has the route of when it was sent; a later stage may have moved since), sending to the
    next stage's current attempt; stage 0's goes on after the client's text deltas, a later
    stage's takes chunks from ``start_seq`` and carries no audio the client already has."""
    s = move.stage
    route = [*task.route[:s], move.to_replica, *seen.route[s + 1 :]]
    update: dict[str, object] = {"route": route, "attempt": move.attempt, "moved": True}
    if s + 1 < len(seen.stages) and seen.stages[s + 1].attempts:
        current = seen.stages[s + 1].attempts[-1]
        update["next_attempt"], update["next_start_seq"] = current.attempt, current.start_seq
    if move.stage == 0:
        update["resume"] = point.deltas
    else:
        update["start_seq"] = start_seq
        if point.audio_seq is not None and task.seq <= point.audio_seq:
            update["codes"] = None
    return task.model_copy(update=update)


def apply_event(rec: RequestRecord, ev: LifecycleEvent) -> None:
    """Fold a lifecycle event into a record.

    A terminal status is final: late events of a finished request only fill in timestamps. An
    attempt the stage has moved past (a replica that resumed after a stall) neither starts nor
    fails it; its ending events still count (it may have finished the stage before the move).
    """
    s = ev.stage
    if (
        s is not None
        and 0 <= s < len(rec.stages)
        and ev.attempt < rec.stages[s].attempt
        and ev.kind in ("started", "failed")
    ):
        return
    started_ns = ev.ts_ns if ev.kind == "started" else ev.started_ns
    if s is not None and 0 <= s < len(rec.stages):
        if started_ns is not None and rec.stages[s].started_ns is None:
            rec.stages[s].started_ns = started_ns
        if ev.kind in ("stage_done", "finished") and rec.stages[s].done_ns is None:
            rec.stages[s].done_ns = ev.ts_ns
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


def ends_client_stream(rec: RequestRecord, ev: LifecycleEvent) -> bool:
    """Whether ``ev`` ends the part of the client's stream that a stage's current attempt sends
    (the gateway is then told how many events that was)."""
    s = ev.stage
    return (
        ev.kind in ("stage_done", "finished")
        and ev.client_events is not None
        and s is not None
        and 0 <= s < len(rec.stages)
        and ev.attempt == rec.stages[s].attempt
    )


async def update_record(kv: KeyValue, key: str, change) -> bool:
    """Read-modify-write of a record with optimistic concurrency (several orchestrators);
    False when there is no such record. A ``change`` that returns False leaves it as it is."""
    for _ in range(KV_RETRIES):
        try:
            entry = await kv.get(key)
        except (NotFoundError, KeyError):
            return False
        rec = RequestRecord.model_validate_json(entry.value)
        if change(rec) is False:
            return True
        try:
            await kv.update(key, rec.model_dump_json().encode(), last=entry.revision)
            return True
        except KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"record {key}: too many concurrent updates")


async def run_orchestrator(settings: OrchestratorSettings, pipeline: PipelineConfig) -> None:
    from libs.common.signals import wait_for_shutdown

    setup_tracing("orchestrator", pipeline.name)
    orch = Orchestrator(settings, pipeline)
    await orch.start()
    freeze_startup_heap()
    await wait_for_shutdown()
    await orch.stop()
    shutdown_tracing()
