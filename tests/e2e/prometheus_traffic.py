"""The known traffic ``test_prometheus`` sends (the official ``openai`` client, text and audio, each
request with a trace id of the client's own) and the ground truth it records while sending: what
the client saw, the bytes and routes a NATS subscriber of our own captured on the bus, and each
request's route as its ``omni_requests`` record says."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import nats
import openai

from libs.common import headers as h
from libs.common.envelopes import StageTask, decode
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier, request_record
from libs.stack.processes import until
from tests.e2e.prometheus_events import audio_stream
from tests.e2e.prometheus_server import WAIT_S


@dataclass
class Traffic:
    t0: float
    """Wall time before the traffic, after every target was scraped in quiet."""
    finish: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    first_audio: list[float] = field(default_factory=list)
    frames: int = 0
    ids: list[str] = field(default_factory=list)
    audio_ids: list[str] = field(default_factory=list)
    bus_bytes: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    bus_hops: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    talker_requests: Counter[str] = field(default_factory=Counter)
    """Chunks with text tokens received per talker replica (each is one talker engine request)."""
    routes: dict[str, list[int]] = field(default_factory=dict)
    """Request id → the replica of each stage, as its ``omni_requests`` record says."""
    bus_routes: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    """Request id → stage → the replica its messages were addressed to on the bus."""
    trace_ids: dict[str, str] = field(default_factory=dict)
    """Request id → the trace id its client chose (sent as ``traceparent``)."""
    seconds: float = 0.0
    t1: float = 0.0
    """Wall time after the last response."""


TEXT_MAX_TOKENS = (3, 7, 5)
AUDIO_MAX_TOKENS = (24, 12)


def _traceparent() -> tuple[str, dict[str, str]]:
    """A trace id of the client's own and the W3C header that continues it (sampled)."""
    trace_id = uuid.uuid4().hex
    return trace_id, {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}


async def _text(client: openai.AsyncOpenAI, model: str, n: int, out: Traffic) -> None:
    trace_id, headers = _traceparent()
    t = time.monotonic()
    r = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=n,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    out.latencies.append(time.monotonic() - t)
    out.finish[r.choices[0].finish_reason] += 1
    out.ids.append(r.id)
    out.trace_ids[r.id] = trace_id


async def _audio(client: openai.AsyncOpenAI, model: str, n: int, out: Traffic) -> None:
    trace_id, headers = _traceparent()
    t = time.monotonic()
    stream = await audio_stream(client, model, n, headers)
    pcm, first, reason, rid = bytearray(), None, None, None
    async for chunk in stream:
        rid = chunk.id
        for c in chunk.choices:
            if c.delta.audio and c.delta.audio.data:
                first = first if first is not None else time.monotonic() - t
                pcm += base64.b64decode(c.delta.audio.data)
            reason = c.finish_reason or reason
    out.latencies.append(time.monotonic() - t)
    assert first is not None and rid and reason, (first, rid, reason)
    out.first_audio.append(first)
    out.frames += len(pcm) // 2
    out.finish[reason] += 1
    out.ids.append(rid)
    out.audio_ids.append(rid)
    out.trace_ids[rid] = trace_id


async def run_traffic(stack, pipeline, out: Traffic) -> None:
    nc = await nats.connect(stack.nats_url)

    async def on_stage_msg(msg) -> None:
        hdr = msg.headers or {}
        edge = (hdr[h.FROM_STAGE], hdr[h.FROM_REPLICA], hdr[h.TO_STAGE], hdr[h.TO_REPLICA])
        out.bus_bytes[edge] += len(msg.data)
        out.bus_hops[edge] += 1
        task = decode(StageTask, msg.data)
        out.bus_routes[task.request_id][int(edge[2])] = edge[3]
        if edge[2] == str(pipeline.speech_stage) and task.token_ids:
            out.talker_requests[edge[3]] += 1

    await nc.subscribe(Subjects(pipeline.name).stages_wildcard, cb=on_stage_msg)
    await barrier(nc)
    client = stack.client(120)
    model = pipeline.served_model_name
    await client.models.list()  # the client's first-use costs (connection, headers) are not the server's
    t = time.monotonic()
    await asyncio.gather(
        *(_text(client, model, n, out) for n in TEXT_MAX_TOKENS),
        *(_audio(client, model, n, out) for n in AUDIO_MAX_TOKENS),
    )
    out.seconds = time.monotonic() - t
    out.t1 = time.time()
    await client.close()
    # The last hops of a request may trail its HTTP response. A stage is done (its record says so)
    # after it sent every output; the flush then brings every hop sent before it to our subscriber.
    for rid in out.ids:
        rec = await done_record(stack, rid)
        out.routes[rid] = [r for r in rec["route"] if r >= 0]  # the stages it ran (the listener skipped)
    await barrier(nc)
    await nc.close()


async def done_record(stack, rid: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    """The ``omni_requests`` record of ``rid`` once every stage of its route is done."""

    async def done() -> dict[str, Any] | None:
        rec = await request_record(stack.nats_url, rid)
        if rec and len(rec["stages"]) == len(rec["route"]) and all(st["done_ns"] for st in rec["stages"]):
            return rec
        return None

    return await until(done, f"{rid}: every stage done", timeout_s)
