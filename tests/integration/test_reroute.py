"""An upstream worker's side of a move of the next stage, against a real nats-server: while the
orchestrator holds a request's chunks nothing is sent; released, the waiting chunk and the later
ones go to the new replica, numbered on, as the new attempt from the given start."""

from __future__ import annotations

import asyncio
import time

import nats
import numpy as np
import pytest

from libs.common.bus import ensure_topology
from libs.common.envelopes import NdArray, StageTask, TaskKind, decode
from libs.common.jetstream import JetStream
from libs.common.subjects import Subjects
from services.orchestrator.migration import stored_inputs
from services.stage_worker.request_context import Bus, Identity, RequestContext

pytestmark = pytest.mark.integration

SUBJECTS = Subjects("reroutetest")


async def _stored(js, replica: int, request_id: str) -> list[StageTask]:
    subject = SUBJECTS.stage_in(2, replica)
    return [
        decode(StageTask, m.data)
        for m in await stored_inputs(js, SUBJECTS.stages_stream, subject, request_id)
    ]


async def test_held_chunks_wait_and_then_go_to_the_new_replica(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = JetStream(nc)
        await ensure_topology(js, SUBJECTS)
        now = time.time_ns()
        first = StageTask(
            request_id=f"rr-{now}",
            gateway_id="g",
            arrival_ns=now,
            deadline_ns=now + 10**10,
            route=[0, 0, 0],
            kind=TaskKind.CHUNK,
            seq=0,
        )
        ctx = RequestContext(Identity(1, 0), Bus(nc, js, SUBJECTS), first)
        codes = NdArray.of(np.arange(4, dtype=np.int32))
        await ctx.downstream(codes=codes)
        assert await ctx.hold() == 1
        waiting = asyncio.create_task(ctx.downstream(codes=codes))
        await asyncio.sleep(0.3)
        assert not waiting.done(), "a chunk was sent while the request was held"
        assert [t.seq for t in await _stored(js, 0, first.request_id)] == [0] and await _stored(
            js, 1, first.request_id
        ) == []

        ctx.release(2, 1, attempt=2, start_seq=1)
        await asyncio.wait_for(waiting, 5)
        await ctx.downstream(final=True, codes=codes)
        assert [t.seq for t in await _stored(js, 0, first.request_id)] == [0]
        moved = await _stored(js, 1, first.request_id)
        assert [(t.seq, t.attempt, t.start_seq, t.route, t.final) for t in moved] == [
            (1, 2, 1, [0, 0, 1], False),
            (2, 2, 1, [0, 0, 1], True),
        ]
    finally:
        await nc.close()
