"""Helpers for tests that play a service on the bus."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.common.bus import services_kv
from libs.common.envelopes import Liveness, StageTask, decode
from libs.common.registry import ServiceKind, ServiceRecord
from libs.common.subjects import Subjects

E = TypeVar("E")


def collect(queue: asyncio.Queue[E], cls: type[E]) -> Callable[[Msg], Awaitable[None]]:
    """A subscription callback that decodes every message as ``cls`` into ``queue``."""

    async def put(msg: Msg) -> None:
        queue.put_nowait(decode(cls, msg.data))

    return put


@contextlib.asynccontextmanager
async def played_worker(
    url: str, pipeline: str, stage: int, replica: int = 0
) -> AsyncIterator[tuple[Client, asyncio.Queue[StageTask]]]:
    """The test as replica ``replica`` of ``stage``: registered (heartbeat every second), answering
    its liveness probes; yields its connection and the tasks sent to it (core NATS: seen, never
    acknowledged). Deregisters on exit."""
    subjects = Subjects(pipeline)
    nc = await nats.connect(url)
    kv = await services_kv(nc.jetstream())
    record = ServiceRecord(
        service=ServiceKind.WORKER,
        pipeline=pipeline,
        instance=f"test-{stage}-{replica}",
        stage=stage,
        replica=replica,
        started_ns=time.time_ns(),
    )
    tasks: asyncio.Queue[StageTask] = asyncio.Queue()

    async def on_task(msg: Msg) -> None:
        tasks.put_nowait(decode(StageTask, msg.data))

    async def on_probe(msg: Msg) -> None:
        await msg.respond(Liveness().encode())

    async def beats() -> None:
        while True:
            await kv.put(record.key, record.model_dump_json().encode())
            await asyncio.sleep(1)

    await nc.subscribe(subjects.stage_in(stage, replica), cb=on_task)
    await nc.subscribe(subjects.alive(stage, replica), cb=on_probe)
    beat = asyncio.create_task(beats())
    await asyncio.sleep(1.5)  # the orchestrator has seen the registration
    try:
        yield nc, tasks
    finally:
        beat.cancel()
        await kv.delete(record.key)
        await nc.close()
