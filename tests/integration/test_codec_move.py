"""A code2wav replica killed (SIGKILL) with chunks of a request waiting for it: a real orchestrator
moves the request to the other real code2wav replica, holding the talker's chunks meanwhile; the new
replica decodes exactly the chunks whose audio the client does not have, and the talker's later
chunks go to it. The test plays the talker (it answers the hold and the release) and the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from libs.common.bus import bucket_keys, requests_kv
from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    ClientEvent,
    ClientEventType,
    NdArray,
    ResumePoint,
    ResumeQuery,
    RouteNotice,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.publish import Hop, publish_task
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from libs.common.subjects import SERVICES_BUCKET, Subjects
from tests.bus import collect
from tests.integration.test_codec_worker import assert_audio_of
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import TALKER_YAML, THINKER_YAML, kill_confirmed, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "c2wmove"
GATEWAY = "gwc2w"
SUBJECTS = Subjects(PIPELINE)
CODE2WAV_X2 = """\
  - name: code2wav
    type: codec
    model: tiny-code2wav
    replicas: 2
    consumes: codec_codes
    emits: audio
    stream_to_client: true
"""
CODES = [[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8], [9, 7, 9, 3], [2, 3, 8]]
"""The talker's code chunks, seq 0 to 4 (the last one final)."""


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """A real orchestrator and both real code2wav replicas (the test plays the talker and gateway)."""
    tmp = tmp_path_factory.mktemp("c2wmove")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML + TALKER_YAML + CODE2WAV_X2)
    services = Services(nats_server.url, path, tmp).start(gateway=False, workers=[(2, 0), (2, 1)])
    with services.serving():
        yield services


def chunk(rid: str, seq: int, route: list[int], attempt: int = 1, start_seq: int = 0) -> StageTask:
    now = time.time_ns()
    return StageTask(
        request_id=rid,
        gateway_id=GATEWAY,
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=route,
        kind=TaskKind.CHUNK,
        seq=seq,
        final=seq == len(CODES) - 1,
        codes=NdArray.of(np.asarray(CODES[seq], dtype=np.int32)),
        attempt=attempt,
        start_seq=start_seq,
    )


async def test_a_killed_code2wav_replica_moves_its_chunks_and_no_audio_is_lost_or_repeated(stack, nc) -> None:
    before = scrape(stack.orchestrator.metrics_url)
    rid = f"c2w-{time.time_ns()}"
    now = time.time_ns()
    record = RequestRecord(
        request_id=rid,
        pipeline=PIPELINE,
        gateway_id=GATEWAY,
        status=RequestStatus.RUNNING,
        route=[0, 0, 0],
        stages=[
            StageProgress(replica=0, started_ns=now, done_ns=now),  # thinker done
            StageProgress(replica=0, started_ns=now, done_ns=now),  # the test is the talker
            StageProgress(
                replica=0, started_ns=now, attempts=[StageAttempt(attempt=1, replica=0, bound_ns=now)]
            ),
        ],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + 60 * 10**9,
        updated_ns=now,
    )
    await (await requests_kv(nc.jetstream())).put(rid, record.model_dump_json().encode())

    audio: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rid), cb=collect(audio, ClientEvent))
    client_has = {"audio_seq": None}
    questions: list[ResumeQuery] = []

    async def gateway(msg) -> None:
        questions.append(decode(ResumeQuery, msg.data))
        await msg.respond(ResumePoint(known=True, audio_seq=client_has["audio_seq"]).encode())

    route_changes: asyncio.Queue[RouteNotice] = asyncio.Queue()

    async def talker(msg) -> None:
        change = decode(RouteNotice, msg.data)
        route_changes.put_nowait(change)
        await msg.respond(ResumePoint(known=True, next_seq=4).encode())

    await nc.subscribe(SUBJECTS.resume(GATEWAY), cb=gateway)
    await nc.subscribe(SUBJECTS.route(1, 0), cb=talker)
    js = nc.jetstream()

    # Chunks 0 and 1 are decoded by replica 0 and reach the client.
    for seq in (0, 1):
        await publish_task(js, SUBJECTS, chunk(rid, seq, [0, 0, 0]), Hop("1", "0", 2, 0))
    got = [await asyncio.wait_for(audio.get(), 10) for _ in range(2)]
    assert [(e.type, e.in_seq, e.replica) for e in got] == [
        (ClientEventType.AUDIO, 0, 0),
        (ClientEventType.AUDIO, 1, 0),
    ]

    await kill_confirmed(stack.worker(2, 0).proc.pid, "code2wav replica 0")
    # Chunks 2 and 3 wait for the dead replica; the client, say, already has chunk 2's audio.
    client_has["audio_seq"] = 2
    for seq in (2, 3):
        await publish_task(js, SUBJECTS, chunk(rid, seq, [0, 0, 0]), Hop("1", "0", 2, 0))

    hold = await asyncio.wait_for(route_changes.get(), 10)
    assert isinstance(hold, ResumeQuery) and (hold.request_id, hold.stage, hold.attempt) == (rid, 2, 2)
    release = await asyncio.wait_for(route_changes.get(), 5)
    assert isinstance(release, AbortNotice)
    assert (release.reason, release.replica, release.attempt) == (MOVED, 1, 2)
    # From the first chunk replica 0 had not acknowledged: 2 at the latest (it acknowledges a chunk
    # once the gateway has confirmed its audio, so 0 and 1 may still be there, sent on without codes).
    assert release.start_seq <= 2
    assert [(q.stage, q.attempt) for q in questions] == [(2, 2)]
    # The talker sends on as told: its last chunk to replica 1, attempt 2.
    last = chunk(rid, 4, [0, 0, 1], attempt=2, start_seq=release.start_seq)
    await publish_task(js, SUBJECTS, last, Hop("1", "0", 2, 1))

    rest = []
    while not rest or rest[-1].type != ClientEventType.AUDIO_DONE:
        rest.append(await asyncio.wait_for(audio.get(), 10))
    assert [(e.type, e.in_seq, e.replica, e.attempt) for e in rest] == [
        (ClientEventType.AUDIO, 3, 1, 2),
        (ClientEventType.AUDIO, 4, 1, 2),
        (ClientEventType.AUDIO_DONE, None, 1, 2),
    ], "chunk 2's audio repeated, or a chunk's audio is missing"
    audio = [e for e in got + rest if e.type == ClientEventType.AUDIO]
    for e in audio:  # each chunk's audio is the decode of that chunk's codes
        assert_audio_of(e.pcm16, CODES[e.in_seq])

    kv = await requests_kv(js)
    for _ in range(50):
        rec = RequestRecord.model_validate_json((await kv.get(rid)).value)
        if rec.status.terminal:
            break
        await asyncio.sleep(0.1)
    assert rec.status == RequestStatus.COMPLETED, rec
    # The moves, as the client saw them: the (attempt, replica) that decoded its audio, in order.
    ran = []
    for e in got + rest:
        if not ran or ran[-1] != (e.attempt, e.replica):
            ran.append((e.attempt, e.replica))
    assert ran == [(1, 0), (2, 1)]
    # The record and the orchestrator's count agree with what the replicas did.
    assert [(a.attempt, a.replica) for a in rec.stages[2].attempts] == ran
    assert rec.stages[2].attempts[-1].reason == "exit"  # killed: its connection went
    after = scrape(stack.orchestrator.metrics_url)
    moves = [(a[1], b[1]) for a, b in itertools.pairwise(ran)]
    for src, dst in moves:
        assert delta(
            before,
            after,
            "vllm:omni_requests_migrated_total",
            stage="2",
            from_replica=str(src),
            to_replica=str(dst),
        ) == moves.count((src, dst))
    assert delta(before, after, "vllm:omni_requests_migrated_total", stage="2") == len(moves)


async def test_a_move_whose_orchestrator_died_before_sending_it_is_carried_out_by_another(stack, nc) -> None:
    """The record as an orchestrator leaves it when it dies between claiming a move (the
    compare-and-set) and sending the request's input: attempt 2 on replica 1, claimed by an
    instance that is not in the registry, never sent. (A real orchestrator cannot be killed in
    that millisecond on demand.) The live orchestrator takes the move over and carries it out; the
    request completes instead of waiting for its deadline."""
    replica0 = stack.worker(2, 0).proc
    if replica0.poll() is None:  # replica 0 is the dead one (the test before killed it)
        os.kill(replica0.pid, signal.SIGKILL)
        replica0.wait(10)
    ghost = "orchestrator-that-died"
    registered = await bucket_keys(nc, SERVICES_BUCKET)  # other tests' keys may expire meanwhile
    assert not [k for k in registered if k.endswith(f".{ghost}")], "the claimer is alive"
    rid = f"c2w-orphan-{time.time_ns()}"
    now = time.time_ns()
    claimed = now - 3 * 10**9
    record = RequestRecord(
        request_id=rid,
        pipeline=PIPELINE,
        gateway_id=GATEWAY,
        status=RequestStatus.RUNNING,
        route=[0, 0, 1],
        stages=[
            StageProgress(replica=0, started_ns=now, done_ns=now),
            StageProgress(replica=0, started_ns=now, done_ns=now),
            StageProgress(
                replica=1,
                attempts=[
                    StageAttempt(attempt=1, replica=0, bound_ns=now),
                    StageAttempt(
                        attempt=2,
                        replica=1,
                        bound_ns=claimed,
                        reason="exit",
                        phase="in_progress",
                        claimed_by=ghost,
                    ),
                ],
            ),
        ],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + 60 * 10**9,
        updated_ns=now,
    )
    js = nc.jetstream()
    audio: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rid), cb=collect(audio, ClientEvent))
    route_changes: asyncio.Queue[RouteNotice] = asyncio.Queue()

    async def gateway(msg) -> None:  # the client has chunks 0 and 1
        await msg.respond(ResumePoint(known=True, audio_seq=1).encode())

    async def talker(msg) -> None:
        route_changes.put_nowait(decode(RouteNotice, msg.data))
        await msg.respond(ResumePoint(known=True, next_seq=4).encode())

    await nc.subscribe(SUBJECTS.resume(GATEWAY), cb=gateway)
    await nc.subscribe(SUBJECTS.route(1, 0), cb=talker)
    for seq in (2, 3):  # what the dead replica 0 had not acknowledged
        await publish_task(js, SUBJECTS, chunk(rid, seq, [0, 0, 0]), Hop("1", "0", 2, 0))
    await (await requests_kv(js)).put(rid, record.model_dump_json().encode())

    hold = await asyncio.wait_for(route_changes.get(), 10)
    release = await asyncio.wait_for(route_changes.get(), 5)
    assert isinstance(hold, ResumeQuery) and isinstance(release, AbortNotice)
    assert (release.reason, release.replica, release.attempt, release.start_seq) == (MOVED, 1, 2, 2)
    await publish_task(js, SUBJECTS, chunk(rid, 4, [0, 0, 1], attempt=2, start_seq=2), Hop("1", "0", 2, 1))
    got = []
    while not got or got[-1].type != ClientEventType.AUDIO_DONE:
        got.append(await asyncio.wait_for(audio.get(), 10))
    assert [(e.type, e.in_seq, e.replica) for e in got] == [
        (ClientEventType.AUDIO, 2, 1),
        (ClientEventType.AUDIO, 3, 1),
        (ClientEventType.AUDIO, 4, 1),
        (ClientEventType.AUDIO_DONE, None, 1),
    ]
    for e in got[:-1]:
        assert_audio_of(e.pcm16, CODES[e.in_seq])
    last = (
        RequestRecord.model_validate_json((await (await requests_kv(js)).get(rid)).value)
        .stages[2]
        .attempts[-1]
    )
    assert last.claimed_by not in (None, ghost) and last.sent_ns is not None, last
