"""The orchestrator: admits requests, binds replicas, dispatches the entry stage, follows the lifecycle.
Stateless (all request state is in ``omni_requests``): any number of instances may run, any may die.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from libs.common.bus import (
    ORCHESTRATOR_ACK_WAIT_S,
    connect,
    consume,
    ensure_topology,
    evictions_kv,
    orchestrator_consumer_config,
    requests_kv,
    services_kv,
)
from libs.common.bus_trust import rejection_counter
from libs.common.consumer import Handler, InProgress, PullConsumer
from libs.common.envelopes import MalformedMessage
from libs.common.jetstream import JetStream
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.metrics_server import start_metrics_server
from libs.common.pipeline import PipelineConfig
from libs.common.registry import Heartbeat, LiveServices, ServiceKind, ServiceRecord
from libs.common.runtime import cancel_and_wait, freeze_startup_heap
from libs.common.settings import OrchestratorSettings
from libs.common.subjects import ORCHESTRATOR_ADMISSION_CONSUMER, ORCHESTRATOR_EVENTS_CONSUMER, Subjects
from libs.common.tracing import setup_tracing, shutdown_tracing
from libs.common.version import VERSION
from services.orchestrator.admission import MAX_CONCURRENT_ADMISSIONS, Admissions
from services.orchestrator.context import OrchestratorContext
from services.orchestrator.deadlines import sweep_deadlines
from services.orchestrator.inflight import InflightRequests
from services.orchestrator.lifecycle import MAX_CONCURRENT_EVENTS, on_event
from services.orchestrator.liveness import ReplicaWatch
from services.orchestrator.moves import Mover
from services.orchestrator.routing import ReplicaPicker
from services.orchestrator.summary import PipelineTally

log = logging.getLogger(__name__)

HEALTH_PERIOD_S = 2.0
LOOP_LAG_PERIOD_S = 0.25


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, pipeline: PipelineConfig) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.subjects = Subjects(pipeline.name)
        self._tasks: list[asyncio.Task[None]] = []
        self._consumers: list[PullConsumer] = []
        self.metrics = MetricSet(Exporter.ORCHESTRATOR, settings.log_stats)
        self._tally = PipelineTally()
        self.model = pipeline.served_model_name

    async def start(self) -> None:
        """Connect, watch the registry and the in-flight requests, judge the replicas, register,
        then take admissions and lifecycle events."""
        self.nc = await connect(self.settings.nats_url, "omnirelay-orchestrator")
        self.js = JetStream(self.nc)
        await ensure_topology(self.js, self.subjects)
        requests = await requests_kv(self.js)
        skv = await services_kv(self.js)
        rejected = rejection_counter(self.metrics, self.model)
        self.services = LiveServices(
            skv, self.pipeline.name, config=self.pipeline, on_rejected=lambda reason, _key: rejected(reason)
        )
        picker = ReplicaPicker(
            self.services,
            lambda rec: self._watch.judged_dead(rec),
            lambda stage, replica: self._watch.answering(stage, replica),
        )
        self._ctx = OrchestratorContext(
            self.nc, self.js, self.subjects, self.pipeline, requests, picker, self.metrics
        )
        await self.services.start()
        await asyncio.wait_for(self.services.ready.wait(), timeout=10)
        self._index = InflightRequests(requests, self.pipeline.name)
        self._tasks.append(await self._index.start())
        mover = Mover(self._ctx, self._index, self.services, self.settings.instance_id)
        own_alive = self.subjects.orchestrator_alive(self.settings.instance_id)
        evictions = await evictions_kv(self.js)
        self._watch = ReplicaWatch(
            self._ctx, self._index, self.services, evictions, mover.evicted, mover.replica_died, own_alive
        )
        self._tasks.append(await self._watch.start())
        self._tasks += [
            asyncio.create_task(sweep_deadlines(self._ctx, self._index), name="deadline-sweep"),
            asyncio.create_task(mover.unfinished_moves_loop(), name="unfinished-moves"),
        ]
        port = await self._register(skv)
        if self.metrics.enabled:
            self._tasks += [
                asyncio.create_task(self._queue_depth_loop(), name="queue-depth"),
                asyncio.create_task(self._loop_lag_loop(), name="loop-lag"),
                asyncio.create_task(self._pipeline_log_loop(), name="pipeline-log"),
            ]
        self._consumers = await self._consume()
        log.info("orchestrator %s: ready, metrics on :%d", self.settings.instance_id, port)

    async def _register(self, skv: KeyValue) -> int:
        """Serve ``/metrics`` and start this instance's registry heartbeat; returns the metrics port."""
        port = start_metrics_server(self.settings.metrics_port, self.settings.metrics_host)
        record = ServiceRecord(
            service=ServiceKind.ORCHESTRATOR,
            pipeline=self.pipeline.name,
            instance=self.settings.instance_id,
            metrics_url=f"http://{self.settings.advertise_host}:{port}/metrics",
            version=VERSION,
        )
        self._heartbeat = Heartbeat(skv, record, lambda: 0)
        await self._heartbeat.start()
        return port

    async def _consume(self) -> list[PullConsumer]:
        """Start taking admissions and lifecycle events, each up to its concurrency limit."""
        admissions = Admissions(self._ctx, self._tally)
        events = functools.partial(on_event, self._ctx, self.settings.log_stats, self._tally)
        limits = self.settings.bus_limits
        return [
            await consume(
                self.nc,
                self.js,
                self.subjects.requests_stream,
                orchestrator_consumer_config(self.subjects.requests, ORCHESTRATOR_ADMISSION_CONSUMER, limits),
                _concurrently(admissions.admit, MAX_CONCURRENT_ADMISSIONS),
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
                _concurrently(events, MAX_CONCURRENT_EVENTS),
                batch=MAX_CONCURRENT_EVENTS,
                name="orchestrator events",
            ),
        ]

    async def _queue_depth_loop(self) -> None:
        """Admissions waiting in the requests stream, every few seconds."""
        gauge = self.metrics["vllm:omni_orchestrator_admission_queue_depth"].labels(self.model)
        stream = self.subjects.requests_stream
        while True:
            try:
                ci = await self.js.consumer_info(stream, ORCHESTRATOR_ADMISSION_CONSUMER)
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
        period_s = self.settings.log_stats_interval_s
        while True:
            await asyncio.sleep(period_s)
            log.info("%s", self._tally.line(self.pipeline.name, len(self._index), period_s))

    async def stop(self) -> None:
        for c in self._consumers:
            await c.stop()
        for t in self._tasks:
            await cancel_and_wait(t)
        await self._heartbeat.stop()
        await self.services.stop()
        with contextlib.suppress(Exception):
            await self.nc.drain()


def _concurrently(handle: Handler, concurrency: int) -> Handler:
    """A message handler that runs ``handle`` on up to ``concurrency`` messages at once (it waits
    for a free slot before taking the next message), each kept in progress meanwhile: a malformed
    message is terminated, one whose handling failed redelivered."""
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def run(msg: Msg) -> None:
        try:
            with InProgress(msg, ORCHESTRATOR_ACK_WAIT_S / 3):
                await handle(msg)
        except MalformedMessage as e:
            log.error("terminating malformed message on %s: %s", msg.subject, e)
            with contextlib.suppress(Exception):
                await msg.term()
        except Exception:
            log.exception("handling %s failed; it will be redelivered", msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    async def start(msg: Msg) -> None:
        await slots.acquire()
        task = asyncio.create_task(run(msg))
        running.add(task)
        task.add_done_callback(running.discard)
        task.add_done_callback(lambda _: slots.release())

    return start


async def run_orchestrator(settings: OrchestratorSettings, pipeline: PipelineConfig) -> None:
    from libs.common.signals import wait_for_shutdown

    setup_tracing("orchestrator", pipeline.name)
    orch = Orchestrator(settings, pipeline)
    await orch.start()
    freeze_startup_heap()
    await wait_for_shutdown()
    await orch.stop()
    shutdown_tracing()
