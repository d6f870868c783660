"""A talker replica killed (SIGKILL) in the middle of a request: a real orchestrator moves the
request to the other real talker replica, holding the thinker's text chunks meanwhile. The new
replica redoes the one text chunk whose codes the dead one had not all sent, and the real code2wav
replica receives every code chunk exactly once: the client's audio is, chunk for chunk, the audio
of the same request without the fault. The test plays the thinker (it sends the text chunks and
answers the move's hold and release) and the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from libs.common import headers as h
from libs.common.bus import requests_kv
from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    ClientEvent,
    ClientEventType,
    Liveness,
    ResumePoint,
    ResumeQuery,
    RouteNotice,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.publish import Hop, publish_task
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier
from libs.stack.processes import until
from tests.bus import abort, collect
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import CODE2WAV_YAML, THINKER_YAML, kill_confirmed, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "talkmove"
GATEWAY = "gwtalk"
SUBJECTS = Subjects(PIPELINE)
TALKER_X2 = """\
  - name: talker
    type: llm
    model: tiny-talker
    replicas: 2
    consumes: text
    emits: codec_codes
    chunking: {codes: 25}
    codes_per_token: 4
    engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}
"""
TEXT = [[10 + 11 * k + i for i in range(11)] for k in range(5)]
"""The thinker's text chunks, seq 0 to 4 (the last one final): 11 tokens each, 44 codes each, so
code chunks (25 codes) straddle text chunks: 220 codes in code chunks 0 to 8."""
CODES = 4 * sum(len(t) for t in TEXT)
CODE_CHUNK = 25
"""Codes per code chunk (``chunking: {codes: 25}`` above)."""
SAMPLES_PER_CODE = 480


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """A real orchestrator, both real talker replicas and code2wav (the test plays the thinker and
    the gateway)."""
    tmp = tmp_path_factory.mktemp("talkmove")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML + TALKER_X2 + CODE2WAV_YAML)
    services = Services(nats_server.url, path, tmp).start(gateway=False, workers=[(1, 0), (1, 1), (2, 0)])
    with services.serving():
        yield services


def text_chunk(rid: str, seq: int, talker: int, attempt: int = 1, start_seq: int = 0) -> StageTask:
    now = time.time_ns()
    return StageTask(
        request_id=rid,
        gateway_id=GATEWAY,
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=[0, talker, 0],
        kind=TaskKind.CHUNK,
        seq=seq,
        final=seq == len(TEXT) - 1,
        token_ids=TEXT[seq],
        offset=sum(len(t) for t in TEXT[:seq]),
        attempt=attempt,
        start_seq=start_seq,
    )


async def running(nc, rid: str, talker: int) -> None:
    """The request's record: the thinker (the test) still running, the talker ``talker`` bound."""
    now = time.time_ns()
    first = [StageAttempt(attempt=1, replica=r, bound_ns=now) for r in (0, talker, 0)]
    record = RequestRecord(
        request_id=rid,
        pipeline=PIPELINE,
        gateway_id=GATEWAY,
        status=RequestStatus.RUNNING,
        route=[0, talker, 0],
        stages=[StageProgress(replica=a.replica, started_ns=now, attempts=[a]) for a in first],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + 60 * 10**9,
        updated_ns=now,
    )
    await (await requests_kv(nc.jetstream())).put(rid, record.model_dump_json().encode())


async def audio_until_done(events: asyncio.Queue[ClientEvent]) -> list[ClientEvent]:
    got: list[ClientEvent] = []
    while not got or got[-1].type != ClientEventType.AUDIO_DONE:
        got.append(await asyncio.wait_for(events.get(), 30))
    return got


async def reference_audio(nc) -> list[ClientEvent]:
    """The events of ``TEXT`` run through talker replica 1 without a fault."""
    rid = f"talk-ref-{time.time_ns()}"
    events: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rid), cb=collect(events, ClientEvent))
    await running(nc, rid, talker=1)
    for seq in range(len(TEXT)):
        await publish_task(nc.jetstream(), SUBJECTS, text_chunk(rid, seq, 1), Hop("0", "0", 1, 1))
    reference = await audio_until_done(events)
    assert [e.in_seq for e in reference[:-1]] == list(range(9))
    return reference


async def test_a_killed_talker_replica_moves_its_request_and_the_audio_is_as_without_the_fault(
    stack, nc
) -> None:
    js = nc.jetstream()

    async def thinker_alive(msg) -> None:  # the test is thinker replica 0, and it lives
        await msg.respond(Liveness().encode())

    async def gateway(msg) -> None:
        await msg.respond(ResumePoint(known=True).encode())

    route_changes: asyncio.Queue[RouteNotice] = asyncio.Queue()

    async def thinker_route(msg) -> None:
        route_changes.put_nowait(decode(RouteNotice, msg.data))
        await msg.respond(ResumePoint(known=True, next_seq=3).encode())

    await nc.subscribe(SUBJECTS.alive(0, 0), cb=thinker_alive)
    await nc.subscribe(SUBJECTS.resume(GATEWAY), cb=gateway)
    await nc.subscribe(SUBJECTS.route(0, 0), cb=thinker_route)

    reference = await reference_audio(nc)

    before = scrape(stack.orchestrator.metrics_url)
    rid = f"talk-{time.time_ns()}"
    events: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rid), cb=collect(events, ClientEvent))
    code_chunks: list[tuple[int, int, int]] = []
    """(talker replica, its attempt, code chunk seq) of every code chunk a talker sent (seen on
    the bus, whatever code2wav or the stream then did with it)."""

    async def sent_to_code2wav(msg) -> None:
        task = decode(StageTask, msg.data)
        if task.request_id == rid:
            code_chunks.append((int(msg.headers[h.FROM_REPLICA]), task.from_attempt, task.seq))

    await nc.subscribe(f"omni.{PIPELINE}.stage.2.>", cb=sent_to_code2wav)
    await running(nc, rid, talker=0)
    for seq in range(3):
        await publish_task(js, SUBJECTS, text_chunk(rid, seq, 0), Hop("0", "0", 1, 0))
    # Text chunks 0-2 make codes 0-131: code chunks 0-4 (codes 0-124) go out; codes 125-131 wait
    # for text chunk 3, so text chunk 2 is not acknowledged.
    early = [await asyncio.wait_for(events.get(), 30) for _ in range(5)]
    assert [e.in_seq for e in early] == [0, 1, 2, 3, 4]

    await kill_confirmed(stack.worker(1, 0).proc.pid, "talker replica 0")
    killed = time.monotonic()

    hold = await asyncio.wait_for(route_changes.get(), 10)
    assert isinstance(hold, ResumeQuery) and (hold.request_id, hold.stage, hold.attempt) == (rid, 1, 2)
    release = await asyncio.wait_for(route_changes.get(), 5)
    moved_s = time.monotonic() - killed
    assert isinstance(release, AbortNotice)
    assert (release.reason, release.replica, release.attempt, release.start_seq) == (MOVED, 1, 2, 2)
    # The thinker sends on as told: text chunks 3 and 4 to replica 1, attempt 2.
    for seq in (3, 4):
        chunk = text_chunk(rid, seq, 1, attempt=2, start_seq=2)
        await publish_task(js, SUBJECTS, chunk, Hop("0", "0", 1, 1))
    rest = await audio_until_done(events)

    got = early + rest
    assert [e.in_seq for e in got[:-1]] == list(range(9)), "a code chunk's audio is missing or repeated"
    assert [e.pcm16 for e in got[:-1]] == [e.pcm16 for e in reference[:-1]], "audio unlike the fault-free run"
    # each code chunk's audio has the samples of its codes (chunks of 25, the last one the rest)
    per_chunk = [min(CODE_CHUNK, CODES - k * CODE_CHUNK) for k in range(9)]
    assert [len(e.pcm16) // 2 for e in got[:-1]] == [n * SAMPLES_PER_CODE for n in per_chunk]
    assert sum(per_chunk) == CODES

    # What the talkers really did: replica 0 (attempt 1) sent the first code chunks, replica 1
    # (attempt 2) the rest; every chunk 0-8 was sent, none after its successor by another replica.
    ran: list[tuple[int, int]] = []
    for replica, attempt, _ in code_chunks:
        if not ran or ran[-1] != (replica, attempt):
            ran.append((replica, attempt))
    assert ran == [(0, 1), (1, 2)], code_chunks
    assert {seq for *_, seq in code_chunks} == set(range(9))
    assert [seq for r, _, seq in code_chunks if r == 0] == [0, 1, 2, 3, 4]

    kv = await requests_kv(js)
    for _ in range(50):
        rec = RequestRecord.model_validate_json((await kv.get(rid)).value)
        if rec.stages[1].done_ns is not None:
            break
        await asyncio.sleep(0.1)
    # The record and the orchestrator's count agree with that.
    assert [(a.replica, a.attempt) for a in rec.stages[1].attempts] == ran
    assert [(a.reason, a.start_seq) for a in rec.stages[1].attempts] == [
        (None, 0),
        ("exit", release.start_seq),
    ]
    after = scrape(stack.orchestrator.metrics_url)
    moves = delta(
        before, after, "vllm:omni_requests_migrated_total", stage="1", from_replica="0", to_replica="1"
    )
    assert moves == len(ran) - 1
    assert delta(before, after, "vllm:omni_requests_migrated_total", stage="1") == len(ran) - 1
    print(
        f"talker move: released {moved_s:.2f} s after the kill; 9 code chunks, each once, as without the fault"
    )


async def test_a_talker_attempt_waiting_in_the_backlog_answers_a_hold_with_its_first_code_chunk(
    stack, nc
) -> None:
    """A talker attempt that took a request over and still waits in the worker's backlog (the
    worker is at ``max_inflight``) answers a hold for the next stage with the code chunk it will
    send first, ``⌈offset × codes_per_token / C⌉``, not 0: a code2wav attempt told to start at 0
    would wait for chunks that went out before the talker's move."""
    js = nc.jetstream()
    stack.worker(1, 0).stop()  # replica 0 again, one request at a time (the test before killed it)
    stack.start_worker(1, 0, {"OMNIRELAY_MAX_INFLIGHT": "1"})
    await stack.ready()

    busy, waiting = f"busy-{time.time_ns()}", f"waiting-{time.time_ns()}"
    for rid in (busy, waiting):
        await running(nc, rid, talker=0)
    await publish_task(js, SUBJECTS, text_chunk(busy, 0, 0), Hop("0", "0", 1, 0))  # it waits for seq 1
    moved = text_chunk(waiting, 2, 0, attempt=2, start_seq=2)
    await publish_task(js, SUBJECTS, moved, Hop("0", "0", 1, 0))
    hold = ResumeQuery(request_id=waiting, stage=2, attempt=2, replica=0)
    for _ in range(100):
        held = decode(ResumePoint, (await nc.request(SUBJECTS.route(1, 0), hold.encode(), timeout=5)).data)
        if held.known:
            break
        await asyncio.sleep(0.1)
    await abort(nc, SUBJECTS, busy, waiting)
    assert held.known, "the worker never held the waiting request"
    # Text chunk 2 starts at token 22, code 88: code chunk 3 (codes 75-99) went out before the
    # move, with the end of text chunk 1; the attempt sends code chunk 4 first.
    assert held.next_seq == 4, held


async def test_chunks_of_a_thinker_attempt_the_request_moved_past_are_dropped(stack, nc) -> None:
    """Stage 0 moved (``ctl.abort``, reason moved, attempt 2) while its old attempt still sends (a
    thinker that resumed after a stall, sampling other tokens): the talker drops the old attempt's
    chunk and counts it; the new attempt's chunks, sent again from seq 0, make exactly the audio of
    the fault-free run."""
    talker1 = stack.worker(1, 1)
    js = nc.jetstream()
    reference = await reference_audio(nc)
    before = scrape(talker1.metrics_url)
    rid = f"fenced-{time.time_ns()}"
    events: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rid), cb=collect(events, ClientEvent))
    await running(nc, rid, talker=1)
    hop = Hop("0", "0", 1, 1)
    await publish_task(js, SUBJECTS, text_chunk(rid, 0, 1), hop)
    # The talker has taken attempt 1's first chunk (its first code chunk's audio is out) before
    # the move: on a loaded box it could still wait in the stream, and be dropped as stale too.
    await until(lambda: events.qsize() > 0, "the audio of attempt 1's first text chunk", timeout_s=60)
    moved = AbortNotice(request_id=rid, reason=MOVED, stage=0, attempt=2)
    await nc.publish(SUBJECTS.abort, moved.encode())
    await barrier(nc)
    # the notice (core NATS) is there before the stale chunk (JetStream)
    await talker1.await_log(
        f"request {rid}: stage 0 moved to attempt 2; chunks of older attempts are stale here", timeout_s=10
    )
    stale = text_chunk(rid, 1, 1).replace(token_ids=[t + 1 for t in TEXT[1]])
    await publish_task(js, SUBJECTS, stale, hop)
    for seq in range(len(TEXT)):
        await publish_task(js, SUBJECTS, text_chunk(rid, seq, 1).replace(from_attempt=2), hop)
    got = await audio_until_done(events)
    assert [e.in_seq for e in got[:-1]] == list(range(9)), "a code chunk's audio is missing or repeated"
    assert [e.pcm16 for e in got[:-1]] == [e.pcm16 for e in reference[:-1]], "the stale chunk was converted"
    after = scrape(talker1.metrics_url)
    assert delta(before, after, "vllm:omni_stale_chunks_dropped_total", stage="1", replica="1") == 1
