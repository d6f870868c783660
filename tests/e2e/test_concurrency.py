"""Many requests at once: all complete, every thinker replica works, no deltas cross requests.

Ground truth per request: the same request run alone first (greedy, so its tokens are fixed by its
own prompt), and what the workers sent for that request id on the bus (captured by a subscriber of
our own). Each request has a prompt and a length of its own, so a delta delivered to the wrong
stream shows as a token that is not that request's.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import nats
import openai
import pytest

from libs.common.envelopes import ClientEvent, ClientEventType
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier, request_record
from tests.bus import client_events

pytestmark = pytest.mark.e2e

N = 32


def _prompt(i: int) -> str:
    return f"Request number {i}: tell me about {('cats', 'ships', 'rain', 'maps')[i % 4]} and number {i * 7}."


@dataclass
class Streamed:
    """What one client saw of its stream."""

    ids: set[str] = field(default_factory=set)
    """Every chunk's id (the gateway's response id: one per stream)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    usage: int | None = None
    finish_reason: str | None = None


async def _one(client: openai.AsyncOpenAI, model: str, i: int) -> Streamed:
    """Request i: its own prompt, greedy, exactly 4 + i tokens, streamed with token ids."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": _prompt(i)}],
        max_tokens=4 + i,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    out = Streamed()
    async for chunk in stream:
        out.ids.add(chunk.id)
        out.usage = chunk.usage.completion_tokens if chunk.usage else out.usage
        for c in chunk.choices:
            out.token_ids.extend((c.model_extra or {}).get("token_ids") or [])
            out.text += c.delta.content or ""
            out.finish_reason = c.finish_reason or out.finish_reason
    return out


async def test_32_concurrent_streams_complete_independently_on_both_replicas(stack, pipeline) -> None:
    client = stack.client(300)
    model = pipeline.served_model_name
    # Alone first: each request's own tokens.
    reference = [await _one(client, model, i) for i in range(N)]
    for i, r in enumerate(reference):
        assert len(r.token_ids) == r.usage == 4 + i and r.finish_reason == "length", (i, r)
    distinct = Counter(tuple(r.token_ids[:4]) for r in reference)
    assert len(distinct) >= N // 2, f"the prompts do not tell the requests apart: {distinct}"

    sent: dict[str, list[ClientEvent]] = defaultdict(list)  # request id → its text events on the bus

    async def on_event(msg) -> None:
        for ev in client_events(msg):  # a batch's subject names no request: the event does
            if ev.type == ClientEventType.TEXT:
                sent[ev.request_id].append(ev)

    nc = await nats.connect(stack.nats_url)
    try:
        await nc.subscribe(Subjects(pipeline.name).out("*", "*"), cb=on_event)
        await barrier(nc)
        results = await asyncio.gather(*(_one(client, model, i) for i in range(N)))
        await barrier(nc)
    finally:
        await nc.close()
    await client.close()

    for i, (got, alone) in enumerate(zip(results, reference, strict=True)):
        assert len(got.ids) == 1, (i, got.ids)
        (rid,) = got.ids
        assert got.usage == len(got.token_ids) == 4 + i, (
            f"request {i}: usage {got.usage}, {len(got.token_ids)} ids"
        )
        # Exactly what the thinker sent for this request id, in its order ...
        on_bus = sorted(sent[rid], key=lambda e: (e.attempt, e.seq))
        assert got.token_ids == [t for e in on_bus for t in e.token_ids], (
            f"request {i}: not what the bus carried"
        )
        assert all(e.request_id == rid for e in on_bus), i
        # ... and the tokens the same request makes alone: none of another request's.
        assert got.token_ids == alone.token_ids, (i, got.token_ids, alone.token_ids)
        assert got.text == alone.text, (i, got.text, alone.text)
    assert len({next(iter(r.ids)) for r in results}) == N
    replicas = Counter()
    for r in results:
        rec = await request_record(stack.nats_url, next(iter(r.ids)))
        replicas[rec["route"][pipeline.thinker_stage]] += 1
    assert set(replicas) == set(range(pipeline.thinker.replicas)), replicas
