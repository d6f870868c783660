"""What a worker keeps of the client events it sent, for the gateway's replays of lost ones, and
its bound (docs/reliability.md: "every worker keeps the events it sent
(``services/stage_worker/sent_events.py``: per attempt, until 30 s after it ends, at most 128 MiB
of ended attempts)").

A real code2wav worker on the session's nats-server decodes ~140 MiB of audio for four requests;
the test plays the talker (sends the code chunks) and the gateway (asks ``ctl.replay.2.0`` for
events, as the gateway does for a gap). Once the ended attempts would exceed 128 MiB, the oldest
ended ones are forgotten first, until they fit; a running attempt is kept whatever the size of
the ended ones, and is not counted against them. Sizes are those of the events on the wire."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from nats.aio.msg import Msg

from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    NdArray,
    Replay,
    ReplayAsk,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.publish import Hop, publish_task
from libs.common.subjects import Subjects
from services.stage_worker.sent_events import KEEP_S, MAX_BYTES
from tests.bus import client_event_bodies
from tests.procs import CODE2WAV_YAML, TALKER_YAML, THINKER_YAML, start_service, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "replaystore"
SUBJECTS = Subjects(PIPELINE)
GATEWAY = "gwreplaystore"
HOP = Hop("1", "0", 2, 0)
CODES = 512
"""Codes per chunk: 491,520 bytes of PCM16 per audio event (a replay answer of one event stays
under NATS' 1 MiB payload limit)."""
MIB = 1 << 20


@pytest.fixture(scope="module")
def worker(nats_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replaystore")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML)
    proc = start_service(["worker"], nats_server.url, path, tmp / "worker.log", {"OMNIRELAY_STAGE": "2"})
    proc.wait_log("serving omni.", timeout_s=120)
    yield proc
    proc.stop()


@dataclass
class Sent:
    """What one request's attempt sent to its gateway, as it passed the broker."""

    events: int = 0
    bytes: int = 0
    first: bytes = b""
    error: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Talker:
    """The test as the talker upstream of code2wav and as the gateway the audio goes to."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.sent: dict[str, Sent] = {}
        self.rng = np.random.default_rng(7)

    async def listen(self) -> None:
        async def on_event(msg: Msg) -> None:
            for body in client_event_bodies(msg):
                event = decode(ClientEvent, body)
                kept = self.sent.setdefault(event.request_id, Sent())
                if kept.events == 0:
                    kept.first = body
                kept.events += 1
                kept.bytes += len(body)
                if event.type == ClientEventType.ERROR:
                    kept.error = f"{event.code}: {event.message}"
                if event.type in (ClientEventType.AUDIO_DONE, ClientEventType.ERROR):
                    kept.done.set()

        await self.nc.subscribe(SUBJECTS.out_wildcard(GATEWAY), cb=on_event, pending_bytes_limit=1 << 30)

    async def send(self, rid: str, chunks: range, last: int) -> None:
        """Chunks ``chunks`` of request ``rid`` (chunk ``last`` is its final one)."""
        now = time.time_ns()
        for seq in chunks:
            codes = self.rng.integers(0, 1024, CODES, dtype=np.int32)
            task = StageTask(
                request_id=rid,
                gateway_id=GATEWAY,
                arrival_ns=now,
                deadline_ns=now + 300 * 10**9,
                route=[0, 0, 0],
                kind=TaskKind.CHUNK,
                seq=seq,
                final=seq == last,
                codes=NdArray.of(codes),
            )
            await publish_task(self.nc.jetstream(), SUBJECTS, task, HOP)

    async def audio_events(self, rid: str, count: int, timeout_s: float = 120.0) -> None:
        """Wait until ``count`` events of ``rid`` have passed."""
        deadline = time.monotonic() + timeout_s
        while self.sent.get(rid, Sent()).events < count:
            assert time.monotonic() < deadline, f"{rid}: {self.sent.get(rid, Sent()).events} events"
            await asyncio.sleep(0.05)

    async def request(self, rid: str, mib: float) -> float:
        """A whole request of about ``mib`` MiB of audio; ``time.monotonic()`` when it ended."""
        chunks = max(1, round(mib * MIB / (CODES * 480 * 2)))
        await self.send(rid, range(chunks), chunks - 1)
        await asyncio.wait_for(self.sent.setdefault(rid, Sent()).done.wait(), 180)
        assert not self.sent[rid].error, self.sent[rid].error
        return time.monotonic()

    async def kept(self, rid: str) -> bool:
        """Whether the worker still has the first event of ``rid`` (asked as the gateway asks)."""
        ask = ReplayAsk(request_id=rid, attempt=1, from_seq=0, to_seq=1)
        reply = decode(Replay, (await self.nc.request(SUBJECTS.replay(2, 0), ask.encode(), timeout=10)).data)
        if reply.known:
            assert reply.events == [self.sent[rid].first], f"{rid}: the replay is not the event sent"
        return reply.known


async def _until(check, timeout_s: float = 10.0) -> None:
    """``await check()`` is true within ``timeout_s`` (the worker forgets right after it sends a
    request's last event)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, check.__doc__
        await asyncio.sleep(0.05)


async def test_ended_attempts_beyond_128_mib_are_forgotten_oldest_first(worker, nc) -> None:
    talker = Talker(nc)
    await talker.listen()
    tag = time.time_ns()
    big, small, running, other = (f"{name}-{tag}" for name in ("big", "small", "running", "other"))
    big_ended = await talker.request(big, 100)
    await talker.request(small, 0.5)
    assert await talker.kept(big) and await talker.kept(small)
    # A running attempt of 40 MiB is kept, and another request's end does not count it.
    chunks = round(40 * MIB / (CODES * 480 * 2))
    await talker.send(running, range(chunks - 1), chunks - 1)
    await talker.audio_events(running, chunks - 1)
    await talker.request(other, 0.5)
    sizes = {rid: talker.sent[rid].bytes for rid in (big, small, other)}
    assert sum(sizes.values()) <= MAX_BYTES < sum(sizes.values()) + talker.sent[running].bytes, sizes
    assert await talker.kept(running)
    assert await talker.kept(big), "an ended attempt was forgotten for a running one's bytes"
    # The running attempt ends: the ended ones no longer fit, and the oldest goes.
    await talker.send(running, range(chunks - 1, chunks), chunks - 1)
    await asyncio.wait_for(talker.sent[running].done.wait(), 60)
    assert not talker.sent[running].error, talker.sent[running].error
    running_ended = time.monotonic()
    assert running_ended - big_ended < KEEP_S, "too slow to tell the byte bound from the 30 s keep"

    async def big_forgotten() -> bool:
        """the oldest ended attempt forgotten"""
        return not await talker.kept(big)

    await _until(big_forgotten)
    kept = {rid: await talker.kept(rid) for rid in (small, other, running)}
    assert kept == {small: True, other: True, running: True}, kept
    total = sum(talker.sent[rid].bytes for rid in kept)
    assert total <= MAX_BYTES, total
    print(
        f"kept {total / MIB:.1f} MiB of ended attempts; forgot the oldest ({sizes[big] / MIB:.1f} MiB) "
        f"{running_ended - big_ended:.1f} s after it ended"
    )
