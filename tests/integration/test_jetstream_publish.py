"""JetStream.publish against a real nats-server: each publish gets its own acknowledgement, and
every failure nats-py reports is reported the same way (no stream, a full stream, no answer),
also after a broker restart."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig
from nats.js.errors import APIError, NoStreamResponseError

from libs.common.jetstream import JetStream
from services.gateway.pipeline_client import JS_STREAM_FULL
from tests.conftest import NatsServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def stream(nats_server, request):
    """A connection, its JetStream and a fresh stream named after the test (``<name>.in``)."""
    nc = await nats.connect(nats_server.url)
    js = JetStream(nc)
    name = request.node.name.replace("_", "").upper()[:24]
    await js.add_stream(
        StreamConfig(name=name, subjects=[f"{name}.in"], max_msgs=64, discard=DiscardPolicy.NEW)
    )
    try:
        yield nc, js, name
    finally:
        await js.delete_stream(name)
        await nc.close()


async def test_concurrent_publishes_each_get_their_own_ack(stream) -> None:
    _nc, js, name = stream
    payloads = [f"m{i}".encode() for i in range(40)]
    acks = await asyncio.gather(*(js.publish(f"{name}.in", p) for p in payloads))
    assert {a.stream for a in acks} == {name}
    assert sorted(a.seq for a in acks) == list(range(1, 41))
    for p, a in zip(payloads, acks, strict=True):  # the ack of a publish names where its message is
        assert (await js.get_msg(name, a.seq)).data == p


async def test_a_repeated_msg_id_is_acked_as_a_duplicate(stream) -> None:
    _nc, js, name = stream
    first = await js.publish(f"{name}.in", b"x", headers={"Nats-Msg-Id": "once"})
    again = await js.publish(f"{name}.in", b"x", headers={"Nats-Msg-Id": "once"})
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    assert (await js.stream_info(name)).state.messages == 1


async def test_a_subject_no_stream_takes_fails_at_once(stream) -> None:
    """At once: on the server's "no responders", not at the end of the publish's timeout (half of
    it tells the two apart with room for a busy machine)."""
    _nc, js, name = stream
    timeout_s = 10.0
    t0 = time.monotonic()
    with pytest.raises(NoStreamResponseError):
        await js.publish(f"{name}.elsewhere", b"x", timeout=timeout_s)
    assert time.monotonic() - t0 < timeout_s / 2


async def test_a_full_stream_refuses_with_its_error_code(stream) -> None:
    _nc, js, name = stream
    for _ in range(64):
        await js.publish(f"{name}.in", b"x")
    with pytest.raises(APIError) as e:
        await js.publish(f"{name}.in", b"x")
    assert e.value.err_code == JS_STREAM_FULL


async def test_no_answer_times_out_and_later_publishes_still_work(stream) -> None:
    nc, js, name = stream
    silent = await nc.subscribe(f"{name}.silent")  # takes the message, never answers
    t0 = time.monotonic()
    with pytest.raises(NatsTimeout):
        await js.publish(f"{name}.silent", b"x", timeout=0.3)
    # after the timeout it was given, not before, nor at the context's own (5 s): nearer to the first
    assert 0.3 <= time.monotonic() - t0 < (0.3 + js._timeout) / 2
    await silent.unsubscribe()
    assert (await js.publish(f"{name}.in", b"y")).seq == 1


async def test_acks_arrive_after_a_broker_restart(tmp_path) -> None:
    server = NatsServer(tmp_path)
    server.start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        js = JetStream(nc)
        await js.add_stream(StreamConfig(name="R", subjects=["r.in"], retention=RetentionPolicy.LIMITS))
        assert (await js.publish("r.in", b"before")).seq == 1
        server.stop()
        server.start()
        async with asyncio.timeout(15):
            while True:
                try:
                    ack = await js.publish("r.in", b"after", timeout=1.0)
                    break
                except (NatsTimeout, NoStreamResponseError, nats.errors.ConnectionClosedError):
                    await asyncio.sleep(0.1)
        assert ack.seq == 2
    finally:
        await nc.close()
        server.stop()
