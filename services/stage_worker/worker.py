"""The stage worker's bus plumbing: pull consumer, per-request tasks, acks, aborts, registry. A
message is acked once its output is published (kept alive until then); a malformed one is terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind, Status, StatusCode

from libs.common import headers as h
from libs.common import tracing
from libs.common.bus import connect, consume, ensure_topology, requests_kv, services_kv, stage_consumer_config
from libs.common.consumer import PullConsumer
from libs.common.envelopes import (
    ENGINE_DEAD,
    MOVED,
    ClientEvent,
    ClientEventType,
    MalformedMessage,
    RouteNotice,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.jetstream import JetStream
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.metrics_server import start_metrics_server
from libs.common.pipeline import PipelineConfig
from libs.common.registry import Heartbeat, ServiceKind, ServiceRecord
from libs.common.runtime import freeze_startup_heap
from libs.common.settings import WorkerSettings
from libs.common.subjects import Subjects, consumer_name, max_deliveries_advisory
from libs.common.version import VERSION
from services.stage_worker.control import ControlAnswers, reroute
from services.stage_worker.engine_health import EngineHealth
from services.stage_worker.event_batcher import ClientEventBatcher
from services.stage_worker.handlers import make_handler
from services.stage_worker.handlers.base import StageError, StageHandler
from services.stage_worker.handlers.listener import Listened
from services.stage_worker.inbox import Delivery
from services.stage_worker.record_check import STALE_START, read_verdict
from services.stage_worker.request_context import Bus, Identity, RequestContext
from services.stage_worker.request_table import Phase, RequestTable, Verdict
from services.stage_worker.transfer_stats import record_transfer, transfer_stats

log = logging.getLogger(__name__)

CONSUMER_STATE_PERIOD_S = 2.0
PULL_BATCH = 64  # messages asked of the stage consumer at a time


class StageWorker:
    """One stage replica: runs its stage's tasks from JetStream on its engine."""

    def __init__(self, settings: WorkerSettings, pipeline: PipelineConfig) -> None:
        if settings.stage >= len(pipeline.stages):
            raise SystemExit(
                f"--stage {settings.stage}: pipeline '{pipeline.name}' ({pipeline.source}) has "
                f"stages 0..{len(pipeline.stages) - 1}"
            )
        declared = pipeline.stages[settings.stage].replicas
        if settings.replica >= declared:
            raise SystemExit(
                f"--replica {settings.replica}: pipeline '{pipeline.name}' ({pipeline.source}) declares "
                f"{declared} replica(s) of stage {settings.stage}; raise 'replicas' to add one"
            )
        self.settings = settings
        self.pipeline = pipeline
        self.stage_cfg = pipeline.stages[settings.stage]
        self.me = Identity(settings.stage, settings.replica)
        self.subjects = Subjects(pipeline.name)
        self.metrics = MetricSet(Exporter.WORKER, settings.log_stats)
        self.handler: StageHandler = make_handler(pipeline, settings, self._listened)
        self._labels = (pipeline.served_model_name, str(settings.stage), str(settings.replica))
        self.requests = RequestTable()
        self.bus: Bus | None = None
        self._records: KeyValue | None = None  # omni_requests, read when a request starts here
        self._heartbeat: Heartbeat | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._consumer: PullConsumer | None = None
        self.health = EngineHealth(
            self.handler, self.stage_cfg.stall_timeout_s, lambda: self.requests.running_count, self.label
        )
        self.control = ControlAnswers(self.me, pipeline, self.handler, self.health, self.requests, self.label)

    def _listened(self, listened: Listened) -> None:
        if self.metrics.enabled:
            self.metrics["vllm:omni_input_audio_duration_s"].labels(*self._labels).observe(listened.audio_s)
            self.metrics["vllm:omni_asr_rtf"].labels(*self._labels).observe(listened.rtf)

    @property
    def label(self) -> str:
        return f"stage {self.me.stage} ({self.stage_cfg.name}) replica {self.me.replica}"

    async def start(self) -> None:
        stage, replica = self.me.stage, self.me.replica
        t0 = time.monotonic()
        await self.handler.start()
        log.info("%s: engine ready in %.1f s", self.label, time.monotonic() - t0)
        # Before the replica is reachable: a full collection of the start-up heap holds the event
        # loop for seconds on a loaded box, and a replica that answers no probe is judged stalled.
        freeze_startup_heap()
        nc = await connect(self.settings.nats_url, f"omnirelay-worker-{stage}-{replica}")
        js = JetStream(nc)
        await ensure_topology(js, self.subjects)
        self.bus = Bus(nc, js, self.subjects, ClientEventBatcher(nc, self.subjects))
        self._records = self.control.records = await requests_kv(js)
        await nc.subscribe(self.subjects.abort, cb=self.control.on_abort)
        if self.metrics.enabled:
            info = (self.stage_cfg.name, self.stage_cfg.type.value, self.stage_cfg.model)
            self.metrics["vllm:omni_stage_info"].labels(*self._labels, *info).set(1)
        port = start_metrics_server(self.settings.metrics_port, self.settings.metrics_host)
        self._consumer = await consume(
            nc,
            js,
            self.subjects.stages_stream,
            stage_consumer_config(self.subjects, stage, replica, self.settings.bus_limits),
            self._dispatch,
            batch=PULL_BATCH,
            name=self.label,
        )
        # Liveness probes are answered before the replica is routable.
        await nc.subscribe(self.subjects.alive(stage, replica), cb=self.control.on_alive)
        await nc.subscribe(self.subjects.route(stage, replica), cb=self.control.on_route)
        record = ServiceRecord(
            service=ServiceKind.WORKER,
            pipeline=self.pipeline.name,
            instance=self.settings.instance_id,
            stage=stage,
            stage_name=self.stage_cfg.name,
            replica=replica,
            metrics_url=f"http://{self.settings.advertise_host}:{port}/metrics",
            version=VERSION,
        )
        self._heartbeat = Heartbeat(
            await services_kv(js), record, lambda: self.requests.running_count, self.health.liveness
        )
        await self._heartbeat.start()
        self._tasks = [
            asyncio.create_task(self._keep_alive_loop(), name="keep-alive"),
            asyncio.create_task(self.health.watch(), name="engine-watch"),
        ]
        if self.metrics.enabled:
            self._tasks.append(asyncio.create_task(self._consumer_state_loop(), name="consumer-state"))
        consumer = consumer_name(stage, replica)
        await nc.subscribe(
            max_deliveries_advisory(self.subjects.stages_stream, consumer), cb=self._on_dead_letter
        )
        log.info("%s: serving %s, metrics on :%d", self.label, self.subjects.stage_in(stage, replica), port)

    async def stop(self, drain_s: float = 10.0) -> None:
        """Stop taking work, let in-flight requests finish for up to ``drain_s``, then leave."""
        if self._consumer:
            await self._consumer.stop()
        pending = [e.run for e in self.requests.running() if e.run is not None]
        if pending:
            log.info("%s: draining %d in-flight request(s)", self.label, len(pending))
            await asyncio.wait(pending, timeout=drain_s)
        for e in self.requests.running():
            if e.run is not None:
                e.run.cancel()
        for t in self._tasks:
            t.cancel()
        if self._heartbeat:
            await self._heartbeat.stop()
        await self.handler.stop()
        if self.bus:
            with contextlib.suppress(Exception):
                await self.bus.nc.drain()

    async def _dispatch(self, msg: Msg) -> None:
        received_ns, t0 = time.time_ns(), time.perf_counter()
        transfer = None
        try:
            task = self._validate(msg)
            if self.metrics.enabled:
                rx_s = time.perf_counter() - t0
                transfer = transfer_stats(
                    msg.headers or {}, received_ns, _stored_ns(msg), rx_s, len(msg.data)
                )
                if transfer is not None:
                    record_transfer(self.metrics, self.pipeline.served_model_name, transfer)
        except MalformedMessage as e:
            if self.metrics.enabled:
                self.metrics["vllm:omni_bus_messages_terminated"].labels(*self._labels, e.reason).inc()
            log.error(
                "%s: terminating malformed message on %s (seq %s): %s",
                self.label,
                msg.subject,
                _stream_seq(msg),
                e,
            )
            with contextlib.suppress(Exception):
                await msg.term()
            return
        if await self._dropped(msg, task):
            return
        phase = entry.phase if (entry := self.requests.get(task.request_id)) is not None else None
        delivery = Delivery(msg, task, received_ns, transfer)
        full = self.requests.running_count >= self.settings.max_inflight
        if phase == Phase.QUEUED or (full and phase != Phase.RUNNING):
            self.requests.queue(delivery)  # started when a request ends (kept alive meanwhile)
            return
        await self._accept(delivery)

    async def _dropped(self, msg: Msg, task: StageTask) -> bool:
        """Whether ``task`` is dropped (:meth:`RequestTable.judge`); acked unless ``LEAVE``."""
        rid = task.request_id
        verdict = self.requests.judge(task)
        if verdict == Verdict.TAKE:
            return False
        if verdict == Verdict.LEAVE:
            log.info(
                "%s: request %s: chunk %d of attempt %d arrived after it moved; left for the move",
                self.label,
                rid,
                task.seq,
                task.attempt,
            )
            return True
        if verdict == Verdict.STALE:
            log.info(
                "%s: request %s: dropping chunk %d of stage %d's attempt %d (it moved on)",
                self.label,
                rid,
                task.seq,
                self.me.stage - 1,
                task.from_attempt,
            )
            if self.metrics.enabled:
                self.metrics["vllm:omni_stale_chunks_dropped"].labels(*self._labels).inc()
        else:
            log.debug("%s: dropping late message for ended request %s", self.label, rid)
        await msg.ack()
        return True

    async def _accept(self, d: Delivery, route: RouteNotice | None = None) -> None:
        """Hand ``d`` to its running request, or start the request with it (and queued ``route``)."""
        msg, task = d.msg, d.task
        rid = task.request_id
        if await self._dropped(msg, task):  # it was queued while its request ended or moved
            return
        ctx = self.requests.running_ctx(rid)
        if ctx is not None and ctx.attempt < task.attempt:
            # The request moved here while its older attempt still winds down here: that ends first.
            run = self.requests.get(rid).run
            ctx.abort(MOVED)
            run.cancel()
            await asyncio.wait([run])
            ctx = self.requests.running_ctx(rid)
        if ctx is None:
            ctx = RequestContext(
                self.me, self.bus, task, span=self._request_span(msg, task), received_s=d.received_s
            )
            if route is not None:
                reroute(ctx, route)
            if self._records is not None:
                ctx.await_clearance()  # the engine starts while the record is read
            self.requests.start(ctx, asyncio.create_task(self._run_request(ctx), name=f"request:{rid}"))
        if not ctx.inbox.put(d):
            log.info("%s: request %s: duplicate seq %d acked and dropped", self.label, rid, task.seq)
            await msg.ack()

    def _request_span(self, msg: Msg, task: StageTask) -> Span:
        """This request's span in this stage: a child of the sender's; a redelivery also links to it."""
        if not tracing.enabled():
            return INVALID_SPAN
        parent = tracing.context_from_headers(msg.headers)
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        links = []
        if attempt > 1 and parent is not None:
            sender = trace.get_current_span(parent).get_span_context()
            links = [Link(sender, {"omnirelay.link": "redelivery"})]
        attrs = {
            "omnirelay.request_id": task.request_id,
            "omnirelay.stage": self.me.stage,
            "omnirelay.stage_name": self.stage_cfg.name,
            "omnirelay.replica": self.me.replica,
            "messaging.system": "nats",
            "messaging.destination.name": msg.subject,
            "messaging.message.delivery_count": attempt,
        }
        return tracing.start_span(
            f"omni.stage {self.stage_cfg.name}", parent, SpanKind.CONSUMER, attrs, links
        )

    def _validate(self, msg: Msg) -> StageTask:
        task = decode(StageTask, msg.data)
        hdr = msg.headers or {}
        to_stage, to_replica = h.header_int(hdr, h.TO_STAGE), h.header_int(hdr, h.TO_REPLICA)
        if (to_stage, to_replica) != (self.me.stage, self.me.replica):
            raise MalformedMessage(
                f"headers address stage {to_stage} replica {to_replica}, this is "
                f"stage {self.me.stage} replica {self.me.replica}",
                "misaddressed",
            )
        if len(task.route) <= self.me.stage or task.route[self.me.stage] != self.me.replica:
            raise MalformedMessage(f"route {task.route} does not bind this replica", "misaddressed")
        if self.pipeline.too_far(task.deadline_ns, time.time_ns()):
            raise MalformedMessage("its deadline lies past the pipeline's request timeout", "bad_deadline")
        expected = TaskKind.START if self.pipeline.takes_start(self.me.stage) else TaskKind.CHUNK
        if task.kind != expected:
            raise MalformedMessage(
                f"stage {self.me.stage} takes '{expected.value}' tasks, got '{task.kind.value}'"
            )
        return task

    async def _check_record(self, ctx: RequestContext, run: asyncio.Task[None]) -> None:
        """Judge the start of ``ctx`` by its record while its handler ``run`` runs."""
        rid = ctx.request_id
        verdict = await read_verdict(self._records, self.me.stage, ctx.first)
        if verdict.drop is not None:
            log.info("%s: request %s: input dropped: %s", self.label, rid, verdict.drop)
            ctx.refuse(STALE_START)
            run.cancel()
            return
        if (down := verdict.downstream) is not None and ctx.route_notices == 0:
            ctx.release(down.stage, down.replica, down.attempt, down.start_seq)
            log.info(
                "%s: request %s: stage %d moved before it started here; its chunks go to replica %d (attempt %d)",
                self.label,
                rid,
                down.stage,
                down.replica,
                down.attempt,
            )
        ctx.clear()

    async def _run_request(self, ctx: RequestContext) -> None:
        rid = ctx.request_id
        check = None
        if ctx.awaits_clearance:
            check = asyncio.create_task(self._check_record(ctx, asyncio.current_task()), name=f"record:{rid}")
        try:
            async with asyncio.timeout(max(ctx.seconds_left, 0.0)):
                await self.handler.run(ctx)
            if self.metrics.enabled:
                ex = {"trace_id": tracing.trace_id_hex(ctx.span)} if ctx.span.is_recording() else None
                took = time.monotonic() - ctx.received_s
                self.metrics["vllm:omni_stage_request_s"].labels(*self._labels).observe(took, ex)
            if ctx.is_last_stage:
                ctx.lifecycle("finished")
        except asyncio.CancelledError:
            log.info("%s: request %s stopped (%s)", self.label, rid, ctx.abort_reason or "shutdown")
        except TimeoutError:
            log.warning("%s: request %s passed its deadline; stopped", self.label, rid)
            await self._report_failure(ctx, 504, "timeout", "the request did not finish before its deadline")
        except StageError as e:
            log.error("%s: request %s failed: %s", self.label, rid, e)
            await self._report_failure(ctx, e.status, e.code, str(e))
        except Exception as e:
            if self.health.engine_died():  # not the request's fault: it moves with the replica's death
                ctx.abort(ENGINE_DEAD)
                log.error("%s: request %s stopped: the engine died", self.label, rid)
                return
            log.exception("%s: request %s failed", self.label, rid)
            status, code = (400, "invalid_request") if isinstance(e, ValueError) else (500, "stage_error")
            await self._report_failure(
                ctx, status, code, f"stage {self.me.stage} ({self.stage_cfg.name}) failed: {e}"
            )
        finally:
            if check is not None:
                check.cancel()
            ctx.close()
            ctx.span.end()
            moved_away = ctx.abort_reason in (MOVED, ENGINE_DEAD)  # the inputs move with the request
            self.requests.end(ctx, moved_away)
            if self._heartbeat:
                self._heartbeat.load_dropped()
            if not moved_away:  # its input was handled, failed or aborted
                for d in ctx.unacked():
                    with contextlib.suppress(Exception):
                        await d.msg.ack()
            await self._start_queued()

    async def _start_queued(self) -> None:
        """Start queued requests, oldest first, while there is room."""
        while self.requests.running_count < self.settings.max_inflight:
            if (queued := self.requests.next_queued()) is None:
                return
            inputs, route = queued
            for d in inputs:
                await self._accept(d, route)

    async def _report_failure(self, ctx: RequestContext, status: int, code: str, message: str) -> None:
        """Tell the client and the orchestrator that the request failed here (unless aborted)."""
        if ctx.aborted:
            return
        ctx.span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
        event = ClientEvent(
            request_id=ctx.request_id, type=ClientEventType.ERROR, status=status, code=code, message=message
        )
        with contextlib.suppress(Exception):
            await ctx.client(event)
        ctx.lifecycle("failed", reason=code)

    async def _keep_alive_loop(self) -> None:
        """In-progress acks for every message held by an active request."""
        period = self.settings.bus_limits.ack_wait_s / 6
        while True:
            await asyncio.sleep(period)
            held = [d for e in self.requests.running() if e.ctx is not None for d in e.ctx.unacked()]
            for msg in [d.msg for d in [*held, *self.requests.queued_inputs()]]:
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _consumer_state_loop(self) -> None:
        """Export this worker's consumer state every few seconds."""
        consumer = consumer_name(self.me.stage, self.me.replica)
        while True:
            try:
                ci = await self.bus.js.consumer_info(self.subjects.stages_stream, consumer)
                for family, value in (
                    ("vllm:omni_bus_consumer_pending", ci.num_pending),
                    ("vllm:omni_bus_consumer_ack_pending", ci.num_ack_pending),
                    ("vllm:omni_bus_consumer_redelivered", ci.num_redelivered),
                ):
                    self.metrics[family].labels(*self._labels).set(value or 0)
            except Exception as e:
                log.debug("%s: consumer info unavailable: %s", self.label, e)
            await asyncio.sleep(CONSUMER_STATE_PERIOD_S)

    async def _on_dead_letter(self, msg: Msg) -> None:
        log.error(
            "%s: a message reached max_deliver and was dropped by JetStream: %s", self.label, msg.data[:300]
        )
        if self.metrics.enabled:
            self.metrics["vllm:omni_bus_dead_lettered"].labels(*self._labels).inc()


def _stored_ns(msg: Msg) -> int | None:
    """JetStream's stored timestamp of a delivered message (broker wall clock, ns)."""
    try:
        return int(msg.metadata.timestamp.timestamp() * 1e9)
    except Exception:
        return None


def _stream_seq(msg: Msg) -> str:
    try:
        return str(msg.metadata.sequence.stream)
    except Exception:
        return "?"


async def run_worker(settings: WorkerSettings, pipeline: PipelineConfig) -> None:
    """Run one worker until SIGINT/SIGTERM."""
    from libs.common.signals import wait_for_shutdown

    tracing.setup_tracing("worker", pipeline.name, settings.stage, settings.replica)
    worker = StageWorker(settings, pipeline)
    await worker.start()
    await wait_for_shutdown()
    log.info("%s: shutting down", worker.label)
    await worker.stop()
    tracing.shutdown_tracing()
