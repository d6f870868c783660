"""The orchestrator moving a thinker request off a replica whose connection died, against a real
nats-server: the stored task goes to a live replica as attempt 2 with what the client has, the
original leaves the stream, the old attempt is told to stop, the record lists both attempts; the
stage's ``migration_limit`` and ``no_replica_wait_s`` end a request that cannot move.

No engines are needed: the test plays the gateway (publishes admissions, answers the resume
question, listens on the out subject) and the workers — each a connection of its own that
heartbeats in ``omni_services`` and answers its liveness probe; closing that connection is the
fault (NATS then answers the orchestrator's probe with "no responders", as after a ``kill -9``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import nats
import pytest

from libs.common.bus import requests_kv, services_kv
from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    Admission,
    ClientEvent,
    ClientEventType,
    Liveness,
    ResumePoint,
    ResumeQuery,
    Sampling,
    StageTask,
    TextDelta,
    decode,
)
from libs.common.records import RequestRecord
from libs.common.registry import ServiceKind, ServiceRecord
from libs.common.subjects import Subjects
from libs.stack.processes import until
from services.orchestrator.migration import stored_inputs
from tests.bus import collect
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import ServiceProcess, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "migtest"
GATEWAY = "gwmig"
SUBJECTS = Subjects(PIPELINE)
THINKERS_YAML = """\
  - name: thinker
    type: llm
    model: tiny-thinker
    replicas: 3
    consumes: text
    emits: text
    stream_to_client: true
    migration_limit: 1
    no_replica_wait_s: 1
    stall_timeout_s: 1
"""
REPLICAS = 3
"""Thinker replicas in the pipeline (the tests start fewer)."""
MOVE_WAIT_S = 30.0
"""How long a test waits for a move or a failure: half the requests' 60 s deadline, so a request
that is only ended by its deadline cannot pass. How fast moves are is measured in benchmarks."""
CLIENT_HAS = [TextDelta(token_ids=[7, 8], text="Hi"), TextDelta(token_ids=[9], text=" there")]


@pytest.fixture(scope="module")
def orchestrator(nats_server, tmp_path_factory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("mig")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKERS_YAML)
    with Services(nats_server.url, path, tmp).start(gateway=False).serving() as services:
        yield services.orchestrator


class FakeWorker:
    """A thinker replica's presence on the bus: registry heartbeats and probe answers, on a
    connection of its own. Its engine is busy and makes progress (one output per answer) until
    :meth:`hang`."""

    def __init__(self, url: str, replica: int) -> None:
        self.url, self.replica = url, replica
        self.record = ServiceRecord(
            service=ServiceKind.WORKER,
            pipeline=PIPELINE,
            instance=f"fake-{replica}-{time.time_ns()}",
            stage=0,
            replica=replica,
            started_ns=time.time_ns(),
        )

    async def start(self) -> FakeWorker:
        self.nc = await nats.connect(self.url)
        self.kv = await services_kv(self.nc.jetstream())
        self.stalled = False
        self.hung = False
        self.answers = 0
        await self.nc.subscribe(SUBJECTS.alive(0, self.replica), cb=self._answer_probe)
        self._beat = asyncio.create_task(self._beats())
        await asyncio.sleep(0.3)
        return self

    async def _answer_probe(self, msg) -> None:
        if not self.stalled:
            if not self.hung:
                self.record.progress += 1
            self.answers += 1
            await msg.respond(Liveness(in_flight=1, busy=1, progress=self.record.progress).encode())

    async def _beats(self) -> None:
        while True:
            await self.kv.put(self.record.key, self.record.model_dump_json().encode())
            await asyncio.sleep(1)

    def hang(self) -> None:
        """Its engine hangs: the worker answers every probe and heartbeats, with work under way
        and its progress counter flat."""
        self.hung = True

    async def die(self) -> None:
        """The process is gone: no more heartbeats, and its connection closes."""
        self._beat.cancel()
        await self.nc.close()
        assert self.nc.is_closed

    async def stall(self) -> None:
        """The process is stopped: it holds its connection and subscriptions but answers nothing
        and beats no more."""
        self._beat.cancel()
        self.stalled = True

    async def forget(self, nc) -> None:
        """After a test: its registration goes (it would linger for the registry's TTL and be
        routed to by the next test)."""
        if not self.nc.is_closed:
            await self.die()
        await (await services_kv(nc.jetstream())).delete(self.record.key)


@contextlib.asynccontextmanager
async def gateway(nc, known: bool = True):
    """The test as the request's gateway: answers the resume question with ``CLIENT_HAS``; yields
    (resume questions, client events)."""
    questions: asyncio.Queue[ResumeQuery] = asyncio.Queue()
    events: asyncio.Queue[ClientEvent] = asyncio.Queue()

    async def answer(msg) -> None:
        questions.put_nowait(decode(ResumeQuery, msg.data))
        await msg.respond(ResumePoint(known=known, deltas=CLIENT_HAS if known else []).encode())

    subs = [
        await nc.subscribe(SUBJECTS.resume(GATEWAY), cb=answer),
        await nc.subscribe(SUBJECTS.out_wildcard(GATEWAY), cb=collect(events, ClientEvent)),
    ]
    try:
        yield questions, events
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def admit(nc) -> Admission:
    now = time.time_ns()
    adm = Admission(
        request_id=f"mig-{now}",
        gateway_id=GATEWAY,
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        prompt_token_ids=[1, 2, 3],
        sampling=Sampling(max_tokens=50, temperature=0),
    )
    await nc.jetstream().publish(SUBJECTS.requests, adm.encode())
    return adm


async def stored(nc, replica: int, request_id: str) -> list[StageTask]:
    """The request's tasks stored for thinker replica ``replica`` (nobody consumes them here)."""
    subject = SUBJECTS.stage_in(0, replica)
    return [
        decode(StageTask, m.data)
        for m in await stored_inputs(nc.jetstream(), SUBJECTS.stages_stream, subject, request_id)
    ]


async def noted_record(nc, request_id: str) -> RequestRecord:
    """The request's record once its latest move is noted in it (the orchestrator notes the
    attempt's phase and resumed tokens after it sent the moved input, so a record read as soon as
    that input is in the stream may not have them yet)."""

    async def noted() -> RequestRecord | None:
        rec = await record(nc, request_id)
        return rec if rec.stages[0].attempts[-1].sent_ns is not None else None

    return await until(noted, "the move's note in the record", MOVE_WAIT_S)


async def holding_replica(nc, request_id: str, other_than: int | None = None, timeout_s: float = 5.0) -> int:
    """The thinker replica whose input subject holds the request's task in the stream (what the
    workers would really be given, not what the record says), once there is one (other than
    ``other_than``)."""

    async def find() -> list[int]:
        return [r for r in range(REPLICAS) if r != other_than and await stored(nc, r, request_id)]

    return (await until(find, "the request's task stored for a replica", timeout_s))[0]


async def record(nc, request_id: str) -> RequestRecord:
    kv = await requests_kv(nc.jetstream())
    return RequestRecord.model_validate_json((await kv.get(request_id)).value)


async def test_a_request_on_a_dead_replica_moves_with_what_the_client_has(
    orchestrator, nats_server, nc
) -> None:
    before = scrape(orchestrator.metrics_url)
    workers = {r: await FakeWorker(nats_server.url, r).start() for r in (0, 1)}
    aborts: asyncio.Queue[AbortNotice] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.abort, cb=collect(aborts, AbortNotice))
    async with gateway(nc) as (questions, _):
        adm = await admit(nc)
        victim = await holding_replica(nc, adm.request_id)
        other = 1 - victim
        (first,) = await stored(nc, victim, adm.request_id)
        await workers[victim].die()
        died = time.monotonic()

        async def moved() -> list[StageTask]:
            return await stored(nc, other, adm.request_id)

        (task,) = await until(moved, "the task stored for the other replica", MOVE_WAIT_S)
        print(f"moved {time.monotonic() - died:.2f} s after the connection closed")
        query = await asyncio.wait_for(questions.get(), 5)
    assert (query.request_id, query.stage, query.attempt) == (adm.request_id, 0, 2)
    assert task.attempt == 2 and task.route == [other] and task.resume == CLIENT_HAS
    assert task.prompt_token_ids == first.prompt_token_ids and task.sampling == first.sampling
    assert await stored(nc, victim, adm.request_id) == [], "the original is still in the stream"
    notice = await asyncio.wait_for(aborts.get(), 5)
    assert (notice.request_id, notice.reason, notice.stage, notice.attempt) == (adm.request_id, MOVED, 0, 2)
    assert questions.empty() and aborts.empty(), "moved more than once"
    # The moves as the workers would see them: the task held for the victim, then one attempt-2
    # task for the other replica. The record and the orchestrator's counts agree with that.
    moves = [(victim, other)]
    rec = await noted_record(nc, adm.request_id)
    assert [(a.attempt, a.replica) for a in rec.stages[0].attempts] == [(first.attempt, victim), (2, other)]
    assert [(a.reason, a.phase, a.resumed_tokens) for a in rec.stages[0].attempts] == [
        (None, None, 0),
        ("exit", "in_progress", sum(len(d.token_ids) for d in CLIENT_HAS)),
    ]
    after = scrape(orchestrator.metrics_url)
    labels = {"stage": "0", "from_replica": str(victim), "to_replica": str(other), "reason": "exit"}
    assert delta(before, after, "vllm:omni_requests_migrated_total", phase="in_progress", **labels) == len(
        moves
    )
    assert delta(before, after, "vllm:omni_requests_migrated_total", stage="0") == len(moves)
    # one replica died (the test closed its connection), so one eviction
    assert delta(before, after, "vllm:omni_replica_evictions_total", stage="0", replica=str(victim)) == 1
    assert delta(before, after, "vllm:omni_replica_evictions_total", stage="0") == 1
    for w in workers.values():
        await w.forget(nc)


async def test_past_its_migration_limit_a_request_fails_fast(orchestrator, nats_server, nc) -> None:
    """``migration_limit: 1``: the second death of its replica ends the request with 503."""
    workers = {r: await FakeWorker(nats_server.url, r).start() for r in (0, 1, 2)}
    async with gateway(nc) as (_, events):
        adm = await admit(nc)
        first = await holding_replica(nc, adm.request_id)
        await workers[first].die()
        now_on = await holding_replica(nc, adm.request_id, other_than=first, timeout_s=MOVE_WAIT_S)
        await workers[now_on].die()
        died = time.monotonic()
        ev = await asyncio.wait_for(events.get(), MOVE_WAIT_S)
        print(f"failed {time.monotonic() - died:.2f} s after the second death")
    assert (ev.type, ev.status, ev.code) == (ClientEventType.ERROR, 503, "migration_limit")
    third = ({0, 1, 2} - {first, now_on}).pop()
    assert await stored(nc, third, adm.request_id) == [], "moved past its migration_limit"
    rec = await noted_record(nc, adm.request_id)
    assert (rec.status, rec.error) == ("failed", "migration_limit")
    for w in workers.values():
        await w.forget(nc)


async def test_with_no_live_replica_to_move_to_a_request_fails_after_no_replica_wait_s(
    orchestrator, nats_server, nc
) -> None:
    only = await FakeWorker(nats_server.url, 0).start()
    async with gateway(nc) as (questions, events):
        adm = await admit(nc)
        assert await holding_replica(nc, adm.request_id) == 0
        await only.die()
        died = time.monotonic()
        ev = await asyncio.wait_for(events.get(), MOVE_WAIT_S)
        took = time.monotonic() - died
    assert (ev.type, ev.status, ev.code) == (ClientEventType.ERROR, 503, "no_live_replica")
    # it waited no_replica_wait_s (1 s) for a replica, then failed (not at its deadline: 503)
    assert took >= 1.0, f"failed {took:.2f} s after the death (no_replica_wait_s: 1)"
    assert questions.empty(), "nothing was moved, so the gateway was not asked"
    await only.forget(nc)


async def test_a_request_on_a_stalled_replica_moves_after_the_stall_timeout(
    orchestrator, nats_server, nc
) -> None:
    """``stall_timeout_s: 1``: a replica that holds its connection but answers no probe."""
    workers = {r: await FakeWorker(nats_server.url, r).start() for r in (0, 1)}
    async with gateway(nc) as (questions, _):
        adm = await admit(nc)
        victim = await holding_replica(nc, adm.request_id)
        await workers[victim].stall()
        stalled = time.monotonic()
        (task,) = await until(
            lambda: stored(nc, 1 - victim, adm.request_id),
            "the task stored for the other replica",
            MOVE_WAIT_S,
        )
        print(f"moved {time.monotonic() - stalled:.2f} s after the stall (stall_timeout_s: 1)")
        await asyncio.wait_for(questions.get(), 5)
    assert task.attempt == 2 and task.resume == CLIENT_HAS
    assert await stored(nc, victim, adm.request_id) == [], "the original is still in the stream"
    rec = await noted_record(nc, adm.request_id)
    # Judged by silence: reason stall (its connection stayed open), once.
    assert [(a.replica, a.reason) for a in rec.stages[0].attempts] == [(victim, None), (1 - victim, "stall")]
    for w in workers.values():
        await w.forget(nc)


async def test_a_request_on_a_replica_whose_engine_hangs_moves_and_the_replica_is_passed_over(
    orchestrator, nats_server, nc
) -> None:
    """``stall_timeout_s: 1``: a replica that answers every probe, busy, with a flat progress
    counter is stalled; while its heartbeats show the same counter no new request goes to it."""
    workers = {r: await FakeWorker(nats_server.url, r).start() for r in (0, 1)}
    async with gateway(nc) as (questions, _):
        adm = await admit(nc)
        victim = await holding_replica(nc, adm.request_id)
        other = 1 - victim
        workers[victim].hang()
        hung, answered = time.monotonic(), workers[victim].answers
        (task,) = await until(
            lambda: stored(nc, other, adm.request_id), "the task stored for the other replica", MOVE_WAIT_S
        )
        took = time.monotonic() - hung
        await asyncio.wait_for(questions.get(), 5)
        assert workers[victim].answers > answered, "the hung replica answered no probe: not a hang"
        later = [await admit(nc) for _ in range(2)]
        routed = [await holding_replica(nc, a.request_id) for a in later]
    # Flat since the last output the orchestrator saw, up to a probe period (0.5 s) before the
    # hang: not judged before stall_timeout_s (1 s) minus that period.
    assert took >= 0.5, f"moved {took:.2f} s after the engine hung (stall_timeout_s: 1)"
    assert task.attempt == 2 and task.resume == CLIENT_HAS
    rec = await noted_record(nc, adm.request_id)
    assert [(a.replica, a.reason) for a in rec.stages[0].attempts] == [(victim, None), (other, "stall")]
    assert routed == [other, other], "a replica with a hung engine was routed to"
    for w in workers.values():
        await w.forget(nc)
