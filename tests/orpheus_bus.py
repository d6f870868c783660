"""The Orpheus pipeline's test stack as the bus shows it: what went to the talkers and to code2wav
(a subscription of the test's own), and a fault-free run of a talker input played by the test."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from nats.aio.msg import Msg

from libs.common import headers as h
from libs.common.bus import requests_kv
from libs.common.envelopes import ClientEvent, ClientEventType, StageTask, TaskKind, decode
from libs.common.publish import Hop, publish_task
from libs.common.records import RequestRecord, RequestStatus, StageAttempt, StageProgress
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier
from tests.bus import client_events, collect
from tests.pipeline_services import openai_client

PIPELINE = "orpheustiny"
MODEL = f"{PIPELINE}-model"
SUBJECTS = Subjects(PIPELINE)


@dataclass
class Capture:
    """What went over the bus for the test's requests: text chunks to the talkers, code chunks to
    code2wav (with the talker replica that sent each)."""

    text: dict[str, list[StageTask]] = field(default_factory=dict)
    codes: dict[str, list[tuple[int, StageTask]]] = field(default_factory=dict)
    on_code: Callable[[str, list[tuple[int, StageTask]]], None] | None = None
    """Called with a request's code chunks so far as each arrives (in the subscription's callback)."""
    on_text: Callable[[str, list[StageTask]], None] | None = None
    """Called with a request's text chunks so far as each arrives (in the subscription's callback)."""

    async def listen(self, nc) -> None:
        async def to_talker(msg: Msg) -> None:
            task = decode(StageTask, msg.data)
            sent = self.text.setdefault(task.request_id, [])
            sent.append(task)
            if self.on_text is not None:
                self.on_text(task.request_id, sent)

        async def to_code2wav(msg: Msg) -> None:
            task = decode(StageTask, msg.data)
            sent = self.codes.setdefault(task.request_id, [])
            sent.append((int(msg.headers[h.FROM_REPLICA]), task))
            if self.on_code is not None:
                self.on_code(task.request_id, sent)

        await nc.subscribe(f"omni.{PIPELINE}.stage.1.>", cb=to_talker)
        await nc.subscribe(f"omni.{PIPELINE}.stage.2.>", cb=to_code2wav)

    def chunks(self, rid: str) -> list[StageTask]:
        """The request's code chunks by seq, each once; a chunk sent twice (a redo after a move)
        must have been sent with the same frames and place."""
        by_seq: dict[int, StageTask] = {}
        for _, t in self.codes.get(rid, []):
            if t.seq in by_seq:
                first = by_seq[t.seq]
                assert (first.offset, first.context_before, first.context_after) == (
                    t.offset,
                    t.context_before,
                    t.context_after,
                ), f"code chunk {t.seq} re-sent at another place"
                np.testing.assert_array_equal(first.codes.to_numpy(), t.codes.to_numpy())
            by_seq.setdefault(t.seq, t)
        assert sorted(by_seq) == list(range(len(by_seq))), f"code chunks not contiguous: {sorted(by_seq)}"
        return [by_seq[s] for s in range(len(by_seq))]


def segments(chunks: list[StageTask]) -> list[tuple[int, np.ndarray]]:
    """(first absolute frame, ``[frames, 7]``) of each segment, rebuilt from its code chunks' own
    frames: a segment's last chunk has no context after it, the next one none before it."""
    out: list[tuple[int, list[np.ndarray]]] = []
    new = True
    for t in chunks:
        codes = t.codes.to_numpy().reshape(-1, 7)
        own = codes[t.context_before : len(codes) - t.context_after]
        if not len(own):
            continue
        if new:
            assert t.context_before == 0, f"chunk {t.seq} opens a segment with context before it"
            out.append((t.offset, []))
        assert out[-1][0] + sum(len(f) for f in out[-1][1]) == t.offset, f"chunk {t.seq} leaves a gap"
        out[-1][1].append(own)
        new = t.context_after == 0
    return [(first, np.concatenate(frames)) for first, frames in out]


async def fault_free_run(
    nc, texts: list[StageTask], talker: int, capture: Capture, voice: str | None = None
) -> tuple[str, bytes]:
    """The same talker input (``texts``, one per seq) run as a new request through talker replica
    ``talker`` without a fault, in ``voice`` (None: the stage's default): the test plays the thinker
    (it sends the text chunks), the orchestrator (it writes the record, with the voice) and the
    gateway (it reads the audio events). Returns the request id and its PCM16 bytes in chunk order."""
    rid, gateway = f"ref-{time.time_ns()}", "gwref"
    now = time.time_ns()
    first = [StageAttempt(attempt=1, replica=r, bound_ns=now) for r in (0, talker, 0)]
    rec = RequestRecord(
        request_id=rid,
        pipeline=PIPELINE,
        gateway_id=gateway,
        status=RequestStatus.RUNNING,
        route=[0, talker, 0],
        stages=[StageProgress(replica=a.replica, started_ns=now, attempts=[a]) for a in first],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + 120 * 10**9,
        updated_ns=now,
        voice=voice,
    )
    js = nc.jetstream()
    await (await requests_kv(js)).put(rid, rec.model_dump_json().encode())
    events: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(gateway, rid), cb=collect(events, ClientEvent))
    for t in texts:
        task = StageTask(
            request_id=rid,
            gateway_id=gateway,
            arrival_ns=now,
            deadline_ns=now + 120 * 10**9,
            route=[0, talker, 0],
            kind=TaskKind.CHUNK,
            seq=t.seq,
            final=t.final,
            text=t.text,
            token_ids=t.token_ids,
            offset=t.offset,
        )
        await publish_task(js, SUBJECTS, task, Hop("0", "0", 1, talker))
    audio: dict[int, bytes] = {}
    while True:
        ev = await asyncio.wait_for(events.get(), 60)
        if ev.type == ClientEventType.AUDIO_DONE:
            break
        assert ev.type == ClientEventType.AUDIO and ev.in_seq not in audio
        audio[ev.in_seq] = ev.pcm16
    return rid, b"".join(audio[s] for s in sorted(audio))


@dataclass
class ClientAudio:
    """One streamed text+audio request as its client saw it (``time.monotonic()`` of the test)."""

    id: str = ""
    pcm: bytearray = field(default_factory=bytearray)
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    """(when it arrived, PCM16 bytes) of each audio chunk, in order."""
    first_audio_s: float | None = None
    """Seconds from just before the request was sent to the first audio chunk's arrival."""
    e2e_s: float = 0.0
    """Seconds from just before the request was sent to the stream's end."""


async def stream_audio_timed(base_url: str, max_tokens: int, voice: str = "alloy") -> ClientAudio:
    """One greedy streamed chat completion with audio (PCM16) in ``voice``, timing each audio chunk
    as it arrives."""
    client = openai_client(base_url, 120)
    seen = ClientAudio()
    t0 = time.monotonic()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=max_tokens,
        temperature=0,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "pcm16"},
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        seen.id = chunk.id
        for c in chunk.choices:
            if c.delta.audio and c.delta.audio.data:
                now = time.monotonic()
                data = base64.b64decode(c.delta.audio.data)
                seen.first_audio_s = seen.first_audio_s or now - t0
                seen.pcm += data
                seen.arrivals.append((now, len(data)))
    seen.e2e_s = time.monotonic() - t0
    await client.close()
    return seen


Edge = tuple[str, str, str, str]
"""(from_stage, from_replica, to_stage, to_replica) as the hop's headers name them."""


@dataclass
class BusLog:
    """Every stage message and client event of the pipeline, seen by a subscriber of the test's own
    (``time.monotonic()`` when each came)."""

    hops: dict[str, dict[Edge, list[int]]] = field(default_factory=dict)
    """Request → edge → the payload bytes of each message on it."""
    first_in: dict[tuple[str, int], float] = field(default_factory=dict)
    """(request, stage) → when the first message to the stage came."""
    audio_done: dict[str, float] = field(default_factory=dict)
    """Request → when its ``audio_done`` event came."""

    async def listen(self, nc) -> None:
        async def on_stage(msg: Msg) -> None:
            now, hdr = time.monotonic(), msg.headers
            rid = decode(StageTask, msg.data).request_id
            edge = (hdr[h.FROM_STAGE], hdr[h.FROM_REPLICA], hdr[h.TO_STAGE], hdr[h.TO_REPLICA])
            self.hops.setdefault(rid, {}).setdefault(edge, []).append(len(msg.data))
            self.first_in.setdefault((rid, int(edge[2])), now)

        async def on_event(msg: Msg) -> None:
            now = time.monotonic()
            for ev in client_events(msg):
                if ev.type == ClientEventType.AUDIO_DONE:
                    self.audio_done[ev.request_id] = now

        await nc.subscribe(SUBJECTS.stages_wildcard, cb=on_stage)
        await nc.subscribe(f"omni.{PIPELINE}.out.>", cb=on_event)
        await barrier(nc)


async def stream_audio(base_url: str, max_tokens: int, voice: str = "alloy") -> bytes:
    """The PCM16 bytes the client got of :func:`stream_audio_timed`."""
    return bytes((await stream_audio_timed(base_url, max_tokens, voice)).pcm)
