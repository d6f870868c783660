"""Events caused on purpose for tests/e2e/test_prometheus.py, each measured independently: an
admission rejected, the audio stage paused, a busy thinker killed with a stale event and chunk
after its move, a message dead-lettered (the module-scoped ``events`` and ``dead_lettered``
fixtures)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import nats
import numpy as np
import openai
import pytest
from nats.js.errors import KeyNotFoundError

from libs.common import headers as h
from libs.common.bus import services_kv
from libs.common.envelopes import ClientEvent, ClientEventType, NdArray, StageTask, TaskKind, decode
from libs.common.pipeline import load_pipeline
from libs.common.publish import Hop, publish_task
from libs.common.registry import ServiceRecord
from libs.common.subjects import Subjects
from libs.stack.bus_state import request_record, snapshot
from libs.stack.processes import until
from tests.bus import await_replacement, dead_letter
from tests.e2e.prometheus_server import eventually
from tests.metrics_scrape import scrape, total
from tests.procs import (
    CODE2WAV_YAML,
    TALKER_YAML,
    THINKER_YAML,
    ServiceProcess,
    kill_confirmed,
    start_service,
    stop_confirmed,
    worker_pid,
    write_pipeline,
)
from tests.speech import padded, spoken

SR = 24_000
"""The audio sample rate (PCM16 mono), Hz."""
DEAD_PIPELINE = "promdead"
THINKER, TALKER = load_pipeline().thinker_stage, load_pipeline().speech_stage
"""The stack's (the default pipeline's) thinker and talker stage ids."""


async def audio_stream(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, headers: dict[str, str] | None = None
) -> openai.AsyncStream:
    """A streamed text + audio (PCM16) request of exactly ``max_tokens`` tokens."""
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Read me a story."}],
        max_tokens=max_tokens,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )


@dataclass
class Events:
    """What the ``events`` fixture caused, as the client and the bus saw it."""

    t0: float
    rejected: int = 0
    """Audio requests whose stream ended with ``codec_input_rejected``."""
    chunks_after_pause: int = 0
    """Audio chunks a stream got after its audio stage was stopped for ``PAUSE_S``."""
    victim: int | None = None
    """The thinker replica killed under two streams."""
    moved: int = 0
    """Streams whose record lists a second thinker attempt (moved off the victim)."""
    stale_sent: bool = False
    """The dead attempt's stale event and chunk were sent after its request moved."""
    victim_started_ns: int = 0
    """When the killed thinker's incarnation started (its replacement starts later)."""
    t1: float = 0.0


def _bad_chunk(task_of: dict[str, Any], codes: list[int]) -> StageTask:
    now = time.time_ns()
    return StageTask(
        request_id=task_of["request_id"],
        gateway_id=task_of["gateway_id"],
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=task_of["route"],
        kind=TaskKind.CHUNK,
        seq=0,
        final=True,
        codes=NdArray.of(np.asarray(codes, dtype=np.int32)),
    )


async def _reject_one(stack, pipeline, js, client: openai.AsyncOpenAI) -> bool:
    """An audio request whose first code chunk the test corrupts: codes out of the codec's range,
    sent to its code2wav replica as chunk 0 as soon as the thinker has started (long before the talker's
    own chunk 0, which the stream then drops as a duplicate). True when the stream ended with
    ``codec_input_rejected`` (False: the talker's chunk got there first)."""
    stream = await audio_stream(client, pipeline.served_model_name, 60)
    subjects = Subjects(pipeline.name)
    try:
        async for chunk in stream:
            rec = None
            for _ in range(50):
                rec = await request_record(stack.nats_url, chunk.id)
                if rec:
                    break
                await asyncio.sleep(0.01)
            assert rec, f"no record of {chunk.id}"
            bad = _bad_chunk(rec, [5, 1 << 20])
            audio = pipeline.audio_stage
            hop = Hop(str(audio - 1), str(rec["route"][audio - 1]), audio, rec["route"][audio])
            await publish_task(js, subjects, bad, hop)
            async for _ in stream:
                pass
            return False
    except openai.APIError as e:
        assert e.code == "codec_input_rejected", e
        return True
    return False


BUSY_TOKENS = 600
"""Tokens of the audio stream under the thinker that is killed (an idle thinker made 300 in 0.7 s,
and once finished them before the strike)."""
TEXT_BUSY_TOKENS = 1200
"""Tokens of the text stream sent before it, which keeps the thinkers busy through the fault."""
LEAD_TOKENS = 10
"""Tokens each stream has had from the thinker when it is killed."""
STALE_SEQ = 10_000
"""The ``seq`` of the stale event and chunk: past any the dead attempt sent (a chunk's
``Nats-Msg-Id`` then is new to the stream, which would drop a repeat before any worker saw it)."""

PAUSE_S = 2.0
"""How long the audio stage is stopped mid-stream: four times a chunk's 0.5 s of audio."""


async def _pause_the_audio_stage(stack, pipeline, client: openai.AsyncOpenAI) -> int:
    """A streamed audio request whose audio stage (its only replica) is stopped (``SIGSTOP``) for
    ``PAUSE_S`` after the first audio chunk, well inside its ``stall_timeout_s``: the client's player
    runs dry and the next chunk is late. Audio that still arrives while the stage is stopped (sent
    before the stop: on a loaded box the client reads behind the server) lengthens the pause by its
    duration, so the player runs dry whatever was in flight. Returns the chunks that came after
    the pause."""
    pid = worker_pid(stack.proc.pid, pipeline.audio_stage, 0)
    stream = await audio_stream(client, pipeline.served_model_name, 60)
    chunks: asyncio.Queue[float | None] = asyncio.Queue()  # seconds of audio per chunk; None: end

    async def read() -> None:
        async for chunk in stream:
            data = "".join(c.delta.audio.data for c in chunk.choices if c.delta.audio and c.delta.audio.data)
            if data:
                chunks.put_nowait(len(base64.b64decode(data)) / 2 / SR)
        chunks.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        assert await asyncio.wait_for(chunks.get(), 60) is not None, "no audio at all"
        try:
            await stop_confirmed(pid, "the audio stage", timeout_s=1.0)
            until = time.monotonic() + PAUSE_S
            while (left := until - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    seconds = await asyncio.wait_for(chunks.get(), left)
                    assert seconds is not None, "the stream ended while its audio stage was stopped"
                    until += seconds
        finally:
            os.kill(pid, signal.SIGCONT)
        after = 0
        while await asyncio.wait_for(chunks.get(), 60) is not None:
            after += 1
        return after
    finally:
        reader.cancel()


async def _stale_after_the_move(pipeline, nc: nats.NATS, rec: dict[str, Any], victim: int) -> None:
    """What a dead thinker attempt could still have had on the way when its request moved on, sent
    as that attempt (1) would have: a text event to the gateway and a text chunk to the talker. The
    gateway and the talker were told of attempt 2 (the ``moved`` notice) and drop them as stale."""
    subjects, rid, now = Subjects(pipeline.name), rec["request_id"], time.time_ns()
    event = ClientEvent(
        request_id=rid,
        type=ClientEventType.TEXT,
        stage=THINKER,
        replica=victim,
        seq=STALE_SEQ,
        text=" stale",
        attempt=1,
    )
    await nc.publish(subjects.out(rec["gateway_id"], rid), event.encode())
    chunk = StageTask(
        request_id=rid,
        gateway_id=rec["gateway_id"],
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=rec["route"],
        kind=TaskKind.CHUNK,
        seq=STALE_SEQ,
        token_ids=[1, 2, 3],
        text=" stale",
        attempt=len(rec["stages"][TALKER]["attempts"]) or 1,
        from_attempt=1,
    )
    hop = Hop(str(THINKER), str(victim), TALKER, rec["route"][TALKER])
    await publish_task(nc.jetstream(), subjects, chunk, hop)


async def _kill_a_busy_thinker(
    stack, pipeline, nc: nats.NATS, client: openai.AsyncOpenAI, out: Events
) -> None:
    """A text stream of ``TEXT_BUSY_TOKENS``, then, once it has ``LEAD_TOKENS``, a streamed audio
    request of ``BUSY_TOKENS``; the moment the thinker has sent the talker ``LEAD_TOKENS`` of the
    audio request's tokens (seen on the bus by a subscriber of our own), ``kill -9`` the thinker
    replica the audio request runs on. Once it has moved, and while its talker still works on
    it, the dead attempt's stale event and chunk are sent
    (``_stale_after_the_move``). Both streams complete; the launcher's replacement is awaited."""
    services = (await snapshot(stack.nats_url, pipeline))["services"]
    incarnations = {s["key"]: s["started_ns"] for s in services}
    ids: list[str] = ["", ""]
    tokens = [0, 0]

    async def stream(i: int) -> None:
        model = pipeline.served_model_name
        s = (
            await audio_stream(client, model, BUSY_TOKENS)
            if i == 0
            else await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Count to a thousand."}],
                max_tokens=TEXT_BUSY_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        async for chunk in s:
            ids[i] = chunk.id
            d = chunk.choices[0].delta if chunk.choices else None
            tokens[i] += bool(d and (d.content or (d.audio and d.audio.transcript)))

    # The thinker's tokens of the audio request as the talker's input carries them: the client's
    # transcript waits for the talker and code2wav, and once came after the thinker had finished.
    to_talker: Counter[str] = Counter()

    async def on_chunk(msg) -> None:
        task = decode(StageTask, msg.data)
        if task.kind == TaskKind.CHUNK:
            to_talker[task.request_id] += len(task.token_ids)

    sub = await nc.subscribe(Subjects(pipeline.name).stage_in(TALKER, "*"), cb=on_chunk)
    text = asyncio.create_task(stream(1))
    deadline = time.monotonic() + 60
    while tokens[1] < LEAD_TOKENS and time.monotonic() < deadline and not text.done():
        await asyncio.sleep(0.025)
    assert tokens[1] >= LEAD_TOKENS, f"the text stream had {tokens[1]} tokens within 60 s"
    streams = [asyncio.create_task(stream(0)), text]
    # Only the audio request has a talker stage.
    while (
        max(to_talker.values(), default=0) < LEAD_TOKENS
        and time.monotonic() < deadline
        and not any(s.done() for s in streams)
    ):
        await asyncio.sleep(0.01)
    await sub.unsubscribe()
    assert max(to_talker.values(), default=0) >= LEAD_TOKENS, f"to the talker within 60 s: {dict(to_talker)}"
    (audio_id,) = to_talker
    rec = await request_record(stack.nats_url, audio_id)
    assert rec and not rec["stages"][THINKER]["done_ns"], rec
    out.victim = rec["route"][THINKER]
    await kill_confirmed(worker_pid(stack.proc.pid, THINKER, out.victim), "the thinker worker")

    # Moved: the record's new attempt has its input sent, which the orchestrator does after it
    # told the workers (the moved notice) and the gateway (its question fences the old attempt).
    async def moved() -> dict | None:
        rec = await request_record(stack.nats_url, audio_id)
        last = rec["stages"][THINKER]["attempts"][-1]
        return rec if last["attempt"] > 1 and last["sent_ns"] else None

    rec = await until(moved, "moved within 10 s of the kill", timeout_s=10)
    last = rec["stages"][THINKER]["attempts"][-1]
    # The talker has taken the moved notice (it logs so): the dead attempt's chunks are stale there.
    await stack.await_log(f"request {audio_id}: stage {THINKER} moved to attempt {last['attempt']}")
    assert not streams[0].done() and not rec["stages"][TALKER]["done_ns"], "the audio request ended too soon"
    await _stale_after_the_move(pipeline, nc, rec, out.victim)
    out.stale_sent = True
    await asyncio.wait_for(asyncio.gather(*streams), 120)
    for rid in ids:
        rec = await request_record(stack.nats_url, rid)
        out.moved += len(rec["stages"][THINKER]["attempts"]) > 1
    out.victim_started_ns = incarnations[f"worker.{pipeline.name}.{THINKER}.{out.victim}"]


async def _talk(stack, pipeline) -> None:
    """A realtime session: a spoken turn (the listener hears it; the answer's first audio gives a
    voice-to-voice latency), then a typed one cancelled at its first audio (an interruption)."""
    with tempfile.TemporaryDirectory() as tmp:
        wav = padded(spoken("Is the kettle on yet?", Path(tmp) / "q.wav").read_bytes(), 0.3, 1.2)
    with av.open(io.BytesIO(wav)) as c:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=24000)
        pcm = b"".join(
            f.to_ndarray().tobytes() for frame in c.decode(audio=0) for f in resampler.resample(frame)
        )
    client = stack.client()
    async with client.realtime.connect(model=pipeline.served_model_name) as conn, asyncio.timeout(120):
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 8})
        for i in range(0, len(pcm), 4800):
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 4800]).decode())
        while (await conn.recv()).type != "response.done":
            pass
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}
        )
        await conn.response.create(response={"max_output_tokens": 400})
        while (await conn.recv()).type != "response.output_audio.delta":
            pass
        await conn.response.cancel()
        while (await conn.recv()).type != "response.done":
            pass
    await client.close()


async def _cause_events(stack, pipeline, out: Events) -> None:
    nc = await nats.connect(stack.nats_url)
    js = nc.jetstream()
    client = stack.client(120)
    try:
        for _ in range(3):  # the race is the test's to lose only if the talker is very fast
            if await _reject_one(stack, pipeline, js, client):
                out.rejected = 1
                break
        await _talk(stack, pipeline)
        out.chunks_after_pause = await _pause_the_audio_stage(stack, pipeline, client)
        await _kill_a_busy_thinker(stack, pipeline, nc, client, out)
        subjects = Subjects(pipeline.name)
        audio = pipeline.audio_stage
        to_codec = {h.TO_STAGE: str(audio), h.TO_REPLICA: "0"}
        await js.publish(subjects.stage_in(audio, 0), b"\xc1", headers=to_codec)  # not msgpack
        ahead = time.time_ns() + 5 * 10**9  # a sender whose clock runs 5 s ahead
        skewed = _bad_chunk(
            {"request_id": f"skew-{uuid.uuid4().hex}", "gateway_id": "nobody", "route": [0] * (audio + 1)},
            [1, 2],
        )
        await js.publish(
            subjects.stage_in(audio, 0),
            skewed.encode(),
            headers={
                **to_codec,
                h.REQUEST_ID: skewed.request_id,
                h.FROM_STAGE: str(audio - 1),
                h.FROM_REPLICA: "0",
                h.SEQ: "0",
                h.FINAL: "true",
                h.TX_START_NS: str(ahead),
                h.TX_END_NS: str(ahead + 1000),
            },
        )
    finally:
        await client.close()
        await nc.close()
    out.t1 = time.time()


@pytest.fixture(scope="module")
def events(stack, pipeline, prom, traffic, dead_letter_under_way) -> Iterator[Events]:
    """Events the traffic does not cause, caused for real after it (the tests comparing the
    traffic's counts have run by then): a codec rejection (a failure and a skipped audio request at
    the gateway), an audio stage stopped for 2 s mid-stream (late chunks), a thinker killed under
    two streams (an eviction and a move) and the dead attempt's stale event and chunk (dropped by
    the gateway and the talker), a malformed stage message (terminated by its worker) and a chunk
    from a sender whose clock runs ahead (two clamped intervals). The killed thinker's
    replacement is awaited at the module's end (its engine starts meanwhile): the modules after
    need the whole stack."""
    prom.wait_scraped_after(traffic.t1 + 1.0)
    out = Events(t0=time.time())
    asyncio.run(_cause_events(stack, pipeline, out))
    yield out
    if out.victim is not None:
        key = f"worker.{pipeline.name}.{THINKER}.{out.victim}"
        asyncio.run(await_replacement(stack.nats_url, pipeline, key, out.victim_started_ns))


def outside_codec_worker(stack, pipeline: str, tmp: Path, **env: str) -> tuple[str, ServiceProcess]:
    """A code2wav worker of pipeline ``pipeline`` on the stack's NATS, started outside the stack
    (``--log-stats``, its own instance id, ``env`` added); returns (instance id, process)."""
    path = write_pipeline(tmp / "p.yaml", pipeline, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML)
    instance = f"{pipeline}-{uuid.uuid4().hex[:8]}"
    env = {"OMNIRELAY_STAGE": "2", "OMNIRELAY_INSTANCE_ID": instance, **env}
    return instance, start_service(["worker"], stack.nats_url, path, tmp / "worker.log", env)


def wait_registered(stack, pipeline: str, worker: ServiceProcess, timeout_s: float = 120.0) -> None:
    """Wait until ``worker`` (:func:`outside_codec_worker` of ``pipeline``) serves: a record of this
    incarnation (started after the process) is in ``omni_services``. Fails if it exits first."""

    async def wait() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            kv = await services_kv(nc.jetstream())

            async def registered() -> bool:
                assert worker.proc is not None and worker.proc.poll() is None, (
                    f"the outside worker exited:\n{worker.text()[-3000:]}"
                )
                with contextlib.suppress(KeyNotFoundError):
                    entry = await kv.get(f"worker.{pipeline}.2.0")
                    return (
                        ServiceRecord.model_validate_json(entry.value or b"").started_ns >= worker.started_ns
                    )
                return False

            await until(registered, f"{pipeline}'s code2wav worker registered", timeout_s, every_s=0.25)
        finally:
            await nc.close()

    asyncio.run(wait())


@dataclass
class DeadLetter:
    """A message JetStream dropped past ``max_deliver`` (``dead_lettered``)."""

    instance: str
    """The worker whose consumer it was on."""
    advisories: int
    """Max-deliveries advisories the test saw."""
    t0: float
    t1: float


@pytest.fixture(scope="module")
def dead_letter_under_way(
    stack, prom, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[DeadLetter]]:
    """A code2wav worker of another pipeline (``DEAD_PIPELINE``), started outside the stack with a
    1 s ``ack_wait`` (the stack's consumers keep their 30 s, whose redeliveries would take 4 min),
    loses a message past ``max_deliver`` (:func:`_lose_one`), in a thread of its own: most of its
    ~17 s is the broker's redelivery backoff, which :func:`events` (a fixture that needs this
    one) spends causing its faults on the stack's own pipeline. The worker runs until the module's
    end: its counter stays a live series for the dashboard check."""
    instance, worker = outside_codec_worker(
        stack, DEAD_PIPELINE, tmp_path_factory.mktemp("deadletter"), OMNIRELAY_ACK_WAIT_S="1"
    )
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="dead-letter") as pool:
            yield pool.submit(_lose_one, stack, prom, instance, worker)
    finally:
        assert worker.stop() == 0, worker.text()[-2000:]


@pytest.fixture(scope="module")
def dead_lettered(dead_letter_under_way: Future[DeadLetter]) -> DeadLetter:
    """The message the outside worker lost (:func:`dead_letter_under_way`), once it is lost."""
    return dead_letter_under_way.result(timeout=120)


def _lose_one(stack, prom, instance: str, worker: ServiceProcess) -> DeadLetter:
    """``worker`` registered and scraped, a message it holds made to pass ``max_deliver``
    (``tests.bus.dead_letter``), counted by it and listed again for Prometheus."""
    wait_registered(stack, DEAD_PIPELINE, worker)
    assert eventually(lambda: prom.scalar(f'up{{instance="{instance}"}}'), lambda v: v == 1) == 1
    t0 = time.time()
    held = _bad_chunk(
        {"request_id": f"dead-{uuid.uuid4().hex}", "gateway_id": "nobody", "route": [0, 0, 0]}, [1, 2]
    )
    held = held.replace(seq=1, final=False)  # chunk 0 never comes: it is held

    async def lose() -> int:
        nc = await nats.connect(stack.nats_url)
        try:
            return await dead_letter(nc, Subjects(DEAD_PIPELINE), Hop("1", "0", 2, 0), held, worker.proc.pid)
        finally:
            await nc.close()

    advisories = asyncio.run(lose())
    # The worker counts the advisory when it runs again (it was stopped when the advisory came);
    # t1 is after its own /metrics shows it.
    counted = eventually(
        lambda: total(scrape(worker.metrics_url), "vllm:omni_bus_dead_lettered_total"), bool, timeout_s=30
    )
    assert counted == 1, f"the worker counted {counted} dead letters"
    t1 = time.time()
    # Stopped for longer than the registry's TTL, it left the service discovery meanwhile: its
    # series are stale until it is listed and scraped again.
    listed = eventually(
        lambda: instance in {g["labels"]["__meta_omnirelay_instance"] for g in prom.sd()}, bool
    )
    assert listed, f"{instance} did not come back to the service discovery"
    return DeadLetter(instance, advisories, t0, t1)
