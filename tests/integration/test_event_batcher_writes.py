"""A worker's client events of one event-loop turn leave in one socket write
(services/stage_worker/event_batcher.py): the turn's first event, published at once, and the
batch of the others, published by the send task in the next turn, reach nats-py's flusher
together. A real nats-server and the real nats-py client; what is counted is every buffer the
client hands its transport, and what arrives is read back by a second client."""

from __future__ import annotations

import asyncio

import nats
import pytest

from libs.common.envelopes import ClientEvent, decode, pack_text, unpack_batch
from libs.common.subjects import Subjects
from services.stage_worker.event_batcher import ClientEventBatcher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

S = Subjects("writes")
REQUESTS = ["r1", "r2", "r3", "r4"]


async def _one_turn(batcher: ClientEventBatcher, step: int) -> None:
    """What an engine step does: every running request's handler adds its event in one turn."""
    await asyncio.gather(
        *(batcher.add("gw", rid, pack_text(rid, 0, 0, step, 1, f"t{step}", [step])) for rid in REQUESTS)
    )


async def test_a_turns_events_leave_in_one_write_and_arrive_in_order(nats_server) -> None:
    sender = await nats.connect(nats_server.url)
    reader = await nats.connect(nats_server.url)
    got: list[tuple[str, int]] = []
    arrived = asyncio.Event()

    async def on_msg(msg) -> None:
        bodies = unpack_batch(msg.data) if msg.subject == S.out_batch("gw") else [msg.data]
        for body in bodies:
            e = decode(ClientEvent, body)
            got.append((e.request_id, e.seq))
        if len(got) == 3 * len(REQUESTS):
            arrived.set()

    await reader.subscribe(S.out("gw", "*"), cb=on_msg)
    await reader.flush()
    writes: list[bytes] = []
    transport = sender._transport
    real = transport.writelines

    def counted(buffers) -> None:
        writes.append(b"".join(buffers))
        real(buffers)

    transport.writelines = counted
    try:
        batcher = ClientEventBatcher(sender, S)
        for step in range(3):
            await _one_turn(batcher, step)
            await asyncio.sleep(0.05)  # the next engine step comes later
        await asyncio.wait_for(arrived.wait(), 5)
    finally:
        transport.writelines = real
        await sender.close()
        await reader.close()
    carrying = [w for w in writes if b"PUB omni.writes.out." in w]
    assert len(carrying) == 3, [w[:120] for w in carrying]  # one write per turn, not two
    for w in carrying:
        assert w.count(b"PUB ") == 2  # the turn's first event alone, then the batch of the rest
    for rid in REQUESTS:
        assert [seq for r, seq in got if r == rid] == [0, 1, 2]
