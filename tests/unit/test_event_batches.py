"""Client events sent together (services/stage_worker/event_batcher.py, ``envelopes.pack_batch``):
which messages carry a turn's events, and that a batch body gives back exactly the bodies put in."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    MalformedMessage,
    decode,
    pack_batch,
    unpack_batch,
)
from libs.common.subjects import Subjects
from services.stage_worker.event_batcher import ClientEventBatcher, frames


def pack_text(rid: str, stage: int, replica: int, seq: int, attempt: int, text: str, ids: list[int]) -> bytes:
    """A text delta's body as a worker sends it."""
    return ClientEvent(
        type=ClientEventType.TEXT,
        request_id=rid,
        stage=stage,
        replica=replica,
        seq=seq,
        attempt=attempt,
        text=text,
        token_ids=ids,
    ).encode()


S = Subjects("p")


def _ev(rid: str, seq: int, text: str = "x") -> tuple[str, bytes]:
    return rid, pack_text(rid, 0, 0, seq, 1, text, [seq])


def _carried(messages: list[tuple[str, bytes]]) -> list[tuple[str, int]]:
    """(request id, seq) of every event the messages carry, in order, read back independently
    of ``frames`` (msgpack, then the gateway's own decoding)."""
    out = []
    for subject, body in messages:
        bodies = unpack_batch(body) if subject == "omni.p.out.gw.~" else [body]
        for b in bodies:
            e = decode(ClientEvent, b)
            if subject != "omni.p.out.gw.~":
                assert subject == f"omni.p.out.gw.{e.request_id}"
            out.append((e.request_id, e.seq))
    return out


def test_a_lone_event_goes_on_its_requests_own_subject_unchanged() -> None:
    rid, body = _ev("r1", 0)
    assert list(frames(S, "gw", [(rid, body)])) == [("omni.p.out.gw.r1", body)]


def test_the_events_of_one_request_go_each_on_its_subject() -> None:
    events = [_ev("r1", 0), _ev("r1", 1), _ev("r1", 2)]
    assert list(frames(S, "gw", events)) == [("omni.p.out.gw.r1", b) for _, b in events]


def test_a_turns_events_go_in_one_batch_in_the_order_they_were_added() -> None:
    events = [_ev("r1", 0), _ev("r2", 0), _ev("r1", 1), _ev("r3", 4)]
    messages = list(frames(S, "gw", events))
    assert [s for s, _ in messages] == ["omni.p.out.gw.~"]
    assert unpack_batch(messages[0][1]) == [b for _, b in events]
    assert _carried(messages) == [("r1", 0), ("r2", 0), ("r1", 1), ("r3", 4)]


def test_batches_hold_at_most_max_bytes_and_a_large_event_goes_alone_in_its_place() -> None:
    small = [_ev(f"r{i}", i) for i in range(6)]
    size = len(small[0][1])
    big = ("rb", pack_text("rb", 0, 0, 0, 1, "y" * (4 * size), [0]))
    events = [*small[:3], big, *small[3:]]
    messages = list(frames(S, "gw", events, max_bytes=2 * size))
    assert _carried(messages) == [(rid, decode(ClientEvent, b).seq) for rid, b in events]
    for subject, body in messages:
        if subject.endswith(".~"):
            assert len(unpack_batch(body)) >= 2 and sum(map(len, unpack_batch(body))) <= 2 * size
    assert ("omni.p.out.gw.rb", big[1]) in messages
    assert [s for s, _ in messages] == [
        "omni.p.out.gw.~",  # r0 r1
        "omni.p.out.gw.r2",  # alone: the big event closes its run
        "omni.p.out.gw.rb",
        "omni.p.out.gw.~",  # r3 r4
        "omni.p.out.gw.r5",
    ]


def test_the_batch_subject_is_no_requests_subject() -> None:
    assert S.out_batch("gw") == "omni.p.out.gw.~"
    with pytest.raises(MalformedMessage):  # no request id can be its last token
        decode(ClientEvent, ClientEvent(request_id="~", type=ClientEventType.TEXT).encode())


@pytest.mark.parametrize(
    "body",
    [
        pack_batch([pack_text("r", 0, 0, 0, 1, "a", [1])])[:-3],  # cut short
        msgpack.packb([1, 2]),  # not binary items
        msgpack.packb({"a": b"x"}),  # not an array
        b"\xc1",  # not msgpack
    ],
)
def test_a_malformed_batch_gives_nothing(body: bytes) -> None:
    with pytest.raises(MalformedMessage):
        unpack_batch(body)


class _SlowNats:
    """A connection whose publishes wait until the test lets them through, recording what went."""

    is_connected = True

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        await self.open.wait()
        self.sent.append((subject, data))


async def test_flushed_returns_once_every_event_added_before_is_on_the_connection() -> None:
    """What a worker's question to the gateway waits for: it must leave after those events."""
    nc = _SlowNats()
    batcher = ClientEventBatcher(nc, S)  # type: ignore[arg-type]
    first = asyncio.create_task(batcher.add("gw", "a", _ev("a", 0)[1]))  # goes at once, alone
    await asyncio.sleep(0)
    for rid, seq in (("a", 1), ("b", 0)):  # the same turn: batched behind it
        await batcher.add("gw", rid, _ev(rid, seq)[1])
    flushed = asyncio.create_task(batcher.flushed())
    await asyncio.sleep(0.01)
    assert not flushed.done(), "flushed before the events left"
    nc.open.set()
    await asyncio.wait_for(asyncio.gather(first, flushed), 5)
    assert _carried(nc.sent) == [("a", 0), ("a", 1), ("b", 0)]
    await batcher.add("gw", "c", _ev("c", 0)[1])  # added after the call: not waited for
    await asyncio.wait_for(batcher.flushed(), 5)
