"""The fault suite's record of the stages stream (:mod:`tests.verification.stage_mirror`) holds every
message the stream stored, across a ``kill -9`` of the broker, although each was acknowledged by its
worker at once; and a message it lacks is counted, so a row can say its reference is incomplete.
A real nats-server, the pipeline's own stream declaration."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import nats
import pytest

from libs.common.bus import ensure_topology
from libs.common.subjects import Subjects, consumer_name
from tests.conftest import NatsServer
from tests.verification.stage_mirror import StageMirror

pytestmark = pytest.mark.integration

PIPELINE = "mirrored"


async def _quiet(_: Exception) -> None:
    return None


async def test_the_mirror_holds_what_the_stream_stored_across_a_broker_kill(tmp_path) -> None:
    server = NatsServer(tmp_path / "jetstream")
    server.start()
    nc = await nats.connect(server.url, error_cb=_quiet, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream()
        subjects = Subjects(PIPELINE)
        await ensure_topology(js, subjects)
        mirror = StageMirror(nc, PIPELINE)
        await mirror.ensure()
        first = await mirror.last_seq()
        worker = await js.pull_subscribe(subjects.stage_in(2, 0), durable=consumer_name(2, 0))
        stored: dict[int, bytes] = {}
        consumed: set[int] = set()
        running = True

        async def publish() -> None:
            n = 0
            while running:
                with contextlib.suppress(Exception):  # the broker is down: that message is not stored
                    ack = await js.publish(subjects.stage_in(2, 0), b"chunk %d" % n, timeout=1)
                    stored[ack.seq] = b"chunk %d" % n
                n += 1
                await asyncio.sleep(0.005)

        async def consume() -> None:  # a worker that acknowledges each message at once
            while running:
                try:
                    for m in await worker.fetch(20, timeout=0.5):
                        consumed.add(m.metadata.sequence.stream)
                        await m.ack()
                except Exception:
                    await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(publish()), asyncio.create_task(consume())]
        await asyncio.sleep(1.5)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(10) == -signal.SIGKILL  # the fault happened
        await asyncio.sleep(2)
        server.start()  # the same ports, the same store
        await asyncio.sleep(3)
        running = False
        await asyncio.gather(*tasks)
        # a message stored before the kill, one after it, and the worker took them
        assert min(stored) < max(stored) and len(consumed) >= len(stored) - 20

        read = await mirror.read_after(first)
        held = {m.seq: m.data for m in read.messages}
        assert read.unread == 0
        assert {s: held.get(s) for s in stored} == stored  # every stored message, as it was stored
        assert all(m.subject == subjects.stage_in(2, 0) for m in read.messages)

        # a message the mirror lacks is counted, not passed over
        some = sorted(held)[len(held) // 2]
        await js.delete_msg(mirror.name, some)
        again = await mirror.read_after(first)
        assert again.unread == 1 and some not in {m.seq for m in again.messages}
    finally:
        await nc.close()
        server.stop()
