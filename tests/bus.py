"""Helpers for tests that play a service on the bus."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from libs.common.bus import services_kv
from libs.common.envelopes import (
    AbortNotice,
    Admission,
    ClientEvent,
    Liveness,
    ResumePoint,
    Sampling,
    StageTask,
    decode,
    unpack_batch,
)
from libs.common.publish import Hop, publish_task
from libs.common.registry import ServiceKind, ServiceRecord
from libs.common.subjects import (
    BATCH_TOKEN,
    SERVICES_BUCKET,
    Subjects,
    consumer_name,
    kv_stream,
    kv_subject,
    max_deliveries_advisory,
)
from libs.stack.bus_state import barrier, request_record, snapshot
from libs.stack.processes import until
from tests.procs import stop_confirmed

E = TypeVar("E")
EVERY_EVENT = 1 << 31
"""A ``ResumePoint.next_seq`` past any attempt's last event."""


def text_admission(gateway_id: str) -> Admission:
    """A chat request's admission from gateway ``gateway_id``: prompt ``[1, 2, 3]``, 8 tokens, due
    30 s from now."""
    now = time.time_ns()
    return Admission(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        gateway_id=gateway_id,
        arrival_ns=now,
        deadline_ns=now + 30 * 10**9,
        prompt_token_ids=[1, 2, 3],
        sampling=Sampling(max_tokens=8),
    )


async def completed_record(nats_url: str, request_id: str, timeout_s: float = 5.0) -> dict:
    """The record of ``request_id`` once it is completed and every stage on its route has reported
    done: each stage's lifecycle events reach the record on their own, so the last stage's
    ``finished`` (which completes it) may be folded in before an earlier stage's ``stage_done``."""
    rec = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = await request_record(nats_url, request_id)
        if rec and rec["status"] == "completed" and all(s["done_ns"] for s in rec["stages"]):
            return rec
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id}: not completed with every stage done within {timeout_s} s: {rec}")


def client_event_bodies(msg: Msg) -> list[bytes]:
    """The bodies of the client events one message carries: its own, or each event's of a
    worker's batch (on ``out.<gateway>.~``, ``Subjects.out_batch``), in order; none for a
    worker's question to the gateway (a request, ``ResumeQuery``)."""
    if msg.reply:
        return []
    return unpack_batch(msg.data) if msg.subject.endswith(f".{BATCH_TOKEN}") else [msg.data]


def client_events(msg: Msg) -> list[ClientEvent]:
    """:func:`client_event_bodies`, decoded."""
    return [decode(ClientEvent, body) for body in client_event_bodies(msg)]


def collect(queue: asyncio.Queue[E], cls: type[E]) -> Callable[[Msg], Awaitable[None]]:
    """A subscription callback that decodes every message as ``cls`` into ``queue`` (each event of
    a batch of client events, for ``ClientEvent``). On a request's ``out`` subject it plays the
    gateway: a worker's question about its events is answered with all of them arrived (the test
    takes every event its subscription gets)."""

    async def put(msg: Msg) -> None:
        if msg.reply and cls is ClientEvent:
            await msg.respond(ResumePoint(known=True, next_seq=EVERY_EVENT).encode())
            return
        for item in client_events(msg) if cls is ClientEvent else [decode(cls, msg.data)]:
            queue.put_nowait(item)

    return put


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether NATS subject ``pattern`` (``*`` one token, ``>`` the rest) covers ``subject``."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or token not in ("*", got[i]):
            return False
    return len(want) == len(got)


async def _consumers(js: JetStreamContext, stream: str) -> list[ConsumerInfo]:
    """Every consumer of ``stream`` (the server lists them 256 at a time)."""
    found: list[ConsumerInfo] = []
    while True:
        page = await js.consumers_info(stream, offset=len(found) or None)
        found += page
        if len(page) < 256:
            return found


async def registry_watchers_have(
    js: JetStreamContext, key: str, revision: int, timeout_s: float = 10.0
) -> int:
    """Wait until every live watcher of ``omni_services`` whose keys include ``key`` has been sent
    the update stored at ``revision``; returns how many watchers that is (at least one).

    A registry view (``LiveServices``: the orchestrator's, the gateway's) is a KV watch, that is an
    ordered push consumer of the bucket's stream; the server reports what it last delivered to each
    (``delivered.stream_seq``) and whether a client still listens (``push_bound``; a watcher of a
    process that has exited lingers unbound for minutes). What the server has sent, a view has
    applied as soon as its event loop reads the connection, before any later message on it."""
    stream, subject = kv_stream(SERVICES_BUCKET), kv_subject(SERVICES_BUCKET, key)

    async def delivered() -> int:
        watching = [
            c
            for c in await _consumers(js, stream)
            if c.push_bound
            and any(
                subject_matches(f, subject)
                for f in (
                    c.config.filter_subjects or [c.config.filter_subject or kv_subject(SERVICES_BUCKET)]
                )
            )
        ]
        return len(watching) if watching and all(c.delivered.stream_seq >= revision for c in watching) else 0

    return await until(delivered, f"every registry watcher sent {key} revision {revision}", timeout_s)


async def consumer_holds(
    js: JetStreamContext, stream: str, consumer: str, seq: int, timeout_s: float = 10.0
) -> None:
    """Wait until durable ``consumer`` of ``stream`` has delivered stream message ``seq`` and it
    waits for its acknowledgement (as the server reports the consumer)."""

    async def held() -> bool:
        info = await js.consumer_info(stream, consumer)
        return info.delivered.stream_seq >= seq and info.num_ack_pending >= 1

    await until(held, f"{consumer} of {stream} holding message {seq}", timeout_s)


@contextlib.asynccontextmanager
async def played_worker(
    url: str, pipeline: str, stage: int, replica: int = 0
) -> AsyncIterator[tuple[Client, asyncio.Queue[StageTask]]]:
    """The test as replica ``replica`` of ``stage``: registered (heartbeat every second), answering
    its liveness probes; yields its connection and the tasks sent to it (core NATS: seen, never
    acknowledged) once every registry view of the pipeline (the orchestrator's among them) has been
    sent its registration. Deregisters on exit."""
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

    async def register() -> int:
        return await kv.put(record.key, record.model_dump_json().encode())

    async def beats() -> None:
        while True:
            await asyncio.sleep(1)
            await register()

    await nc.subscribe(subjects.stage_in(stage, replica), cb=on_task)
    await nc.subscribe(subjects.alive(stage, replica), cb=on_probe)
    await barrier(nc)  # subscribed before anyone can know of this replica
    revision = await register()
    beat = asyncio.create_task(beats())
    try:
        await registry_watchers_have(nc.jetstream(), record.key, revision)
        yield nc, tasks
    finally:
        beat.cancel()
        await kv.delete(record.key)
        await nc.close()


async def dead_letter(
    nc: Client, subjects: Subjects, hop: Hop, task: StageTask, pid: int, timeout_s: float = 30
) -> int:
    """Make JetStream drop ``task`` past ``max_deliver`` on the worker ``hop`` leads to (process
    ``pid``, whose ``task`` must wait for an input that never comes, and whose ``ack_wait`` should
    be short): once it holds the message it is stopped (``SIGSTOP``: no in-progress acks), and the
    caller pulls from the same consumer and never acknowledges until the server's max-deliveries
    advisory comes; then the worker is resumed and ``task``'s request aborted, so that the worker
    holds nothing afterwards. Returns the advisories seen (1 when it worked)."""
    advisories: asyncio.Queue[Msg] = asyncio.Queue()
    consumer = consumer_name(hop.to_stage, hop.to_replica)
    sub = await nc.subscribe(max_deliveries_advisory(subjects.stages_stream, consumer), cb=advisories.put)
    ack = await publish_task(nc.jetstream(), subjects, task, hop)
    await consumer_holds(nc.jetstream(), subjects.stages_stream, consumer, ack.seq)
    try:
        await stop_confirmed(pid, "the worker")
        puller = await nc.jetstream().pull_subscribe_bind(consumer, subjects.stages_stream)
        deadline = time.monotonic() + timeout_s
        while advisories.empty() and time.monotonic() < deadline:
            with contextlib.suppress(nats.errors.TimeoutError):
                await puller.fetch(1, timeout=2)  # taken and never acknowledged
        await puller.unsubscribe()
    finally:
        os.kill(pid, signal.SIGCONT)
    await sub.unsubscribe()
    await abort(nc, subjects, task.request_id)
    return advisories.qsize()


async def abort(nc: Client, subjects: Subjects, *request_ids: str) -> None:
    """Abort ``request_ids`` as a client that hung up would: every worker stops them, so none
    waits for inputs that will never come when the test's services stop (a worker's stop waits
    up to 10 s for its requests in flight)."""
    for rid in request_ids:
        await nc.publish(subjects.abort, AbortNotice(request_id=rid, reason="client disconnected").encode())
    await barrier(nc)


async def await_replacement(
    nats_url: str, pipeline, key: str, started_ns: int, timeout_s: float = 300
) -> None:
    """Wait until the registry lists service ``key`` with an incarnation started after
    ``started_ns`` (the launcher's replacement of a killed process: /health alone still counts the
    dead one until its registration expires)."""

    async def back() -> bool:
        now = {s["key"]: s for s in (await snapshot(nats_url, pipeline))["services"]}
        return key in now and now[key]["started_ns"] > started_ns

    await until(
        back, f"{key} back (an incarnation started after the kill registered)", timeout_s, every_s=0.5
    )


async def in_flight(
    nc: Client, subjects: Subjects, stage: int, replica: int, timeout_s: float = 1.0
) -> int | None:
    """The requests a worker holds, as it says in its answer to the liveness probe the
    orchestrators send; None when it does not answer within ``timeout_s`` (none subscribed, or a
    broker or worker too slow)."""
    with contextlib.suppress(nats.errors.Error):
        reply = await nc.request(subjects.alive(stage, replica), b"", timeout=timeout_s)
        return decode(Liveness, reply.data).in_flight
    return None


async def holds_nothing(nc: Client, subjects: Subjects, stage: int, replica: int) -> bool:
    """Whether the worker answers its liveness probe holding no request (:func:`in_flight`)."""
    return await in_flight(nc, subjects, stage, replica) == 0
