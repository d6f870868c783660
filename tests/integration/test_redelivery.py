"""A worker dies holding a message: JetStream redelivers it to the replica's next incarnation,
which finishes the request; its span is linked to the sender's and records the delivery count."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import nats
import numpy as np
import pytest

from libs.common.envelopes import ClientEvent, ClientEventType, NdArray, StageTask, TaskKind
from libs.common.publish import Hop, publish_task
from libs.common.subjects import Subjects, consumer_name
from libs.common.tracing import start_span
from libs.stack.processes import until
from tests.bus import collect, consumer_holds, dead_letter
from tests.metrics_scrape import delta, scrape, total
from tests.otlp_receiver import Receiver, start_receiver, tracing_in_this_process
from tests.pipeline_services import Services
from tests.procs import CODE2WAV_YAML, TALKER_YAML, THINKER_YAML, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "redeliv"
SUBJECTS = Subjects(PIPELINE)
HOP = Hop("1", "0", 2, 0)


def _chunk(rid: str, seq: int, final: bool) -> StageTask:
    now = time.time_ns()
    return StageTask(
        request_id=rid,
        gateway_id="gw3",
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=[0, 0, 0],
        kind=TaskKind.CHUNK,
        seq=seq,
        final=final,
        codes=NdArray.of(np.arange(3, dtype=np.int32)),
    )


REDELIVERED = "vllm:omni_bus_consumer_redelivered"


async def gauge_becomes(url: str, name: str, value: float, timeout_s: float = 8.0) -> None:
    """Wait until the worker's gauge reads ``value`` (it is refreshed every 2 s)."""
    await until(lambda: total(scrape(url), name) == value, f"{name} = {value}", timeout_s, every_s=0.25)


@pytest.fixture
def otlp(monkeypatch) -> Iterator[Receiver]:
    """An OTLP receiver that this process (the sender, playing the talker) exports to."""
    server, receiver = start_receiver()
    for k, v in {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }.items():
        monkeypatch.setenv(k, v)
    try:
        with tracing_in_this_process("test", PIPELINE):
            yield receiver
    finally:
        server.shutdown()


async def test_redelivered_message_is_finished_by_the_next_worker_with_a_linked_span(
    nats_server, tmp_path, otlp
) -> None:
    path = write_pipeline(tmp_path / "p.yaml", PIPELINE, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML)
    tracing = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_BSP_SCHEDULE_DELAY")
    env = {"OMNIRELAY_ACK_WAIT_S": "1", **{k: os.environ[k] for k in tracing}}
    services = Services(nats_server.url, path, tmp_path, env)
    nc = await nats.connect(nats_server.url)
    try:
        first = services.start_worker(2)
        await services.ready()
        rid = f"redeliver-{time.time_ns()}"
        events: asyncio.Queue = asyncio.Queue()
        await nc.subscribe(SUBJECTS.out("gw3", rid), cb=collect(events, ClientEvent))
        sender = start_span("talker (test)")
        ack = await publish_task(nc.jetstream(), SUBJECTS, _chunk(rid, 1, final=True), HOP, sender)
        # delivered; seq 0 has not come, so seq 1 is held un-acked
        await consumer_holds(nc.jetstream(), SUBJECTS.stages_stream, consumer_name(HOP.to_stage, 0), ack.seq)
        os.killpg(first.pid, signal.SIGKILL)  # dies holding seq 1, un-acked
        assert first.proc.wait(10) == -signal.SIGKILL
        second = services.start_worker(2)
        await services.ready()
        metrics = second.metrics_url
        # The consumer's state, as the new incarnation reports it: one message redelivered and
        # waiting for its acknowledgement (seq 1, held until seq 0 comes).
        await gauge_becomes(metrics, REDELIVERED, 1.0)  # the redelivery reported
        await publish_task(nc.jetstream(), SUBJECTS, _chunk(rid, 0, final=False), HOP, sender)
        got = []
        while not got or got[-1].type != ClientEventType.AUDIO_DONE:
            got.append(await asyncio.wait_for(events.get(), 30))
        assert [e.type for e in got] == [
            ClientEventType.AUDIO,
            ClientEventType.AUDIO,
            ClientEventType.AUDIO_DONE,
        ]
        await gauge_becomes(metrics, REDELIVERED, 0.0)  # acknowledged: no longer redelivered
        sender.end()
        trace_id = format(sender.get_span_context().trace_id, "032x")
        spans = await until(
            lambda: [s for s in otlp.trace(trace_id) if s.name == "omni.stage code2wav"],
            "the code2wav span exported",
            every_s=0.2,
        )
        (span,) = spans
        sender_id = format(sender.get_span_context().span_id, "016x")
        assert span.parent_span_id == sender_id
        # the request's first message (seq 1) was a redelivery: the new attempt says so
        assert span.attributes["messaging.message.delivery_count"] == 2
        assert [(t, s, a) for t, s, a in span.links] == [
            (trace_id, sender_id, {"omnirelay.link": "redelivery"})
        ]
    finally:
        await nc.close()
        services.stop()


async def test_a_message_past_max_deliver_is_counted_as_dead_lettered(nats_server, tmp_path) -> None:
    """A worker stopped (``SIGSTOP``) while it holds a message sends no in-progress acks, so
    JetStream redelivers it (the test pulls from the same consumer and never acknowledges) until
    ``max_deliver``, then drops it with an advisory. The worker, resumed, reads the advisory and
    counts it: ``vllm:omni_bus_dead_lettered_total`` moves by exactly the advisories seen."""
    path = write_pipeline(tmp_path / "p.yaml", PIPELINE, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML)
    # JetStream redelivers after 1, 1, 2 and 4 ack waits: 4 s to the advisory at 0.5 s each.
    services = Services(nats_server.url, path, tmp_path, {"OMNIRELAY_ACK_WAIT_S": "0.5"})
    nc = await nats.connect(nats_server.url)
    try:
        worker = services.start_worker(2)
        await services.ready()
        metrics = worker.metrics_url
        before = scrape(metrics)
        held = _chunk(f"deadletter-{time.time_ns()}", 1, final=True)  # chunk 0 never comes
        seen = await dead_letter(nc, SUBJECTS, HOP, held, worker.proc.pid)
        assert seen == 1, "no max-deliveries advisory within 30 s"
        await until(
            lambda: delta(before, scrape(metrics), "vllm:omni_bus_dead_lettered_total") >= 1,
            "the dead letter counted",
            every_s=0.2,
        )
        # Time passes in which a second, wrong count of the one advisory would show (the worker
        # counts an advisory the moment it reads it).
        await asyncio.sleep(1.0)
        assert delta(before, scrape(metrics), "vllm:omni_bus_dead_lettered_total") == seen
    finally:
        await nc.close()
        services.stop()
