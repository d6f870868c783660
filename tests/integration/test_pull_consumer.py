"""PullConsumer against a real nats-server: every message handed over once and in order, standing
requests topped up, expired requests renewed, lost requests (consumer re-created) recovered."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from libs.common import consumer as consumer_module
from libs.common.bus import consume
from libs.common.consumer import LOST_GRACE_S, NEXT_API, WATCH_PERIOD_S, PullConsumer
from libs.stack.bus_state import barrier
from libs.stack.processes import until

pytestmark = pytest.mark.integration


class Received:
    """What the handler was given: payloads in order, and when each arrived (monotonic, s)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.at: list[float] = []
        self.changed = asyncio.Event()

    async def handle(self, msg) -> None:
        self.payloads.append(msg.data)
        self.at.append(time.monotonic())
        await msg.ack()
        self.changed.set()

    async def wait_for(self, count: int, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.payloads) < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def bus(nats_server, request):
    """A connection and a fresh work-queue stream named after the test."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    name = request.node.name.replace("_", "").upper()[:24]
    await js.add_stream(
        StreamConfig(name=name, subjects=[f"{name}.in"], retention=RetentionPolicy.WORK_QUEUE)
    )
    try:
        yield nc, js, name
    finally:
        await js.delete_stream(name)
        await nc.close()


class PullRequests:
    """The pull requests the client sends for consumer ``c`` of a stream (as another subscriber of
    their subject sees them), each with when it was seen (``time.monotonic()``, s)."""

    def __init__(self) -> None:
        self.at: list[float] = []

    async def watch(self, nc, stream: str) -> PullRequests:
        async def seen(msg) -> None:
            self.at.append(time.monotonic())

        await nc.subscribe(NEXT_API.format(stream=stream, consumer="c"), cb=seen)
        await barrier(nc)
        return self


def _config(name: str) -> ConsumerConfig:
    return ConsumerConfig(durable_name="c", filter_subject=f"{name}.in", ack_policy=AckPolicy.EXPLICIT)


async def _start(bus, got: Received, batch: int, expires_s: float) -> PullConsumer:
    nc, js, name = bus
    await js.add_consumer(name, _config(name))
    consumer = PullConsumer(nc, name, "c", got.handle, batch=batch, expires_s=expires_s, name="t")
    await consumer.start()
    return consumer


async def test_every_message_once_in_order_beyond_many_batches(bus) -> None:
    nc, js, name = bus
    got = Received()
    consumer = await consume(nc, js, name, _config(name), got.handle, batch=4, name="t")
    sent = [str(i).encode() for i in range(50)]
    for body in sent:
        await js.publish(f"{name}.in", body)
    await got.wait_for(len(sent), 10)
    await barrier(nc)  # the handler's acks are on the server
    info = await js.consumer_info(name, "c")
    # The server delivered each message once (its delivery count would count a second time) and
    # every one is acknowledged: nothing is left that could come again.
    assert info.delivered.consumer_seq == len(sent) and info.num_redelivered == 0
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert got.payloads == sent
    # at most `batch` messages are asked for at a time: a handful of standing requests, not 50
    assert 1 <= info.num_waiting <= 4
    await consumer.stop()


async def test_messages_keep_coming_after_requests_expire(bus, monkeypatch) -> None:
    """A request that expires (408) is renewed at once, so one always stands and a message
    published later is taken by a request that was already standing. The watchdog, which would
    also top the requests up once a second, is silenced here: what renews them is the 408."""
    monkeypatch.setattr(consumer_module, "WATCH_PERIOD_S", 60.0)
    nc, js, name = bus
    got = Received()
    asked = await PullRequests().watch(nc, name)
    consumer = await _start(bus, got, batch=2, expires_s=0.3)
    await js.publish(f"{name}.in", b"first")
    await got.wait_for(1, 5)
    handled = len(asked.at)
    await until(lambda: len(asked.at) >= handled + 4, "the requests expire and are renewed several times")
    renewed = len(asked.at)
    await until(lambda: len(asked.at) > renewed, "one more renewal")  # a fresh request stands now
    assert (await js.consumer_info(name, "c")).num_waiting >= 1, "the server holds no standing request"
    await js.publish(f"{name}.in", b"after")
    await got.wait_for(2, 5)
    assert got.payloads == [b"first", b"after"]
    await consumer.stop()


async def test_lost_requests_are_renewed(bus) -> None:
    """The consumer is deleted and re-created under the client (as after a broker restart): its
    standing requests are gone, and the watchdog asks again."""
    nc, js, name = bus
    got = Received()
    asked = await PullRequests().watch(nc, name)
    consumer = await _start(bus, got, batch=8, expires_s=1.0)
    await until(lambda: asked.at, "the first pull request")
    await js.delete_consumer(name, "c")
    deleted = len(asked.at)
    # the client is told (409) and asks again, of a consumer that is gone
    await until(lambda: len(asked.at) > deleted, "a pull request after the deletion")
    await js.add_consumer(name, _config(name))
    await js.publish(f"{name}.in", b"x")
    # Renewed at the latest when the watchdog (1 s ticks) has heard nothing for expires + grace;
    # the rest of the deadline is slack for a busy machine: without renewal it would never come.
    await got.wait_for(1, consumer.expires_s + LOST_GRACE_S + WATCH_PERIOD_S + 5)
    assert got.payloads == [b"x"]
    await barrier(nc)  # the handler's ack is on the server
    assert (await js.consumer_info(name, "c")).num_ack_pending == 0
    await consumer.stop()


async def test_stop_hands_over_nothing_more(bus) -> None:
    nc, js, name = bus
    got = Received()
    consumer = await consume(nc, js, name, _config(name), got.handle, batch=8, name="t")
    await js.publish(f"{name}.in", b"before")
    await got.wait_for(1, 5)
    await consumer.stop()
    await js.publish(f"{name}.in", b"after")
    # The next reader of the consumer gets it: the stopped one's requests no longer stand (the
    # server serves pull requests in order, and would have given it to one of those first).
    reader = await js.pull_subscribe_bind("c", name)
    (msg,) = await reader.fetch(1, timeout=5)
    assert msg.data == b"after" and msg.metadata.num_delivered == 1
    await msg.ack()
    assert got.payloads == [b"before"]


async def test_batch_must_be_positive(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        with pytest.raises(ValueError, match="batch"):
            PullConsumer(nc, "S", "c", Received().handle, batch=0)
    finally:
        await nc.close()


async def test_a_refused_request_is_retried_once_a_second_not_in_a_loop(bus) -> None:
    """A push consumer refuses pull requests at once (409, nothing pending reported)."""
    nc, js, name = bus
    await js.add_consumer(name, ConsumerConfig(durable_name="c", deliver_subject=f"{name}.push"))
    asked: list[float] = []

    async def count(msg) -> None:
        asked.append(time.monotonic())

    await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{name}.c", cb=count)
    await barrier(nc)
    consumer = PullConsumer(nc, name, "c", Received().handle, batch=8, name="t")
    t0 = time.monotonic()
    await consumer.start()
    await asyncio.sleep(2.5)  # the time over which the requests are counted
    await consumer.stop()
    await barrier(nc)
    ticks = (time.monotonic() - t0) / WATCH_PERIOD_S
    # one at the start and one per watchdog tick (a loop would send thousands); at least one retry
    assert 2 <= len(asked) <= ticks + 1, f"{len(asked)} pull requests in {ticks:.1f} watchdog periods"
