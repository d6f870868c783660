"""Many requests at once: all complete, every thinker replica works, no deltas cross requests."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest

from libs.common.bus_state import request_record

pytestmark = pytest.mark.e2e

N = 32


async def _one(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, int, list[int], str]:
    """Request i asks for exactly 4 + i tokens; returns (id, usage tokens, streamed ids, text)."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Request number {i}."}],
        max_tokens=4 + i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    rid, ids, text, usage = None, [], [], None
    async for chunk in stream:
        assert rid in (None, chunk.id), "a chunk of another request arrived in this stream"
        rid = chunk.id
        usage = chunk.usage or usage
        for c in chunk.choices:
            ids.extend((c.model_extra or {}).get("token_ids") or [])
            text.append(c.delta.content or "")
    return rid, usage.completion_tokens, ids, "".join(text)


async def test_32_concurrent_streams_complete_independently_on_both_replicas(stack, pipeline) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    results = await asyncio.gather(*(_one(client, pipeline.served_model_name, i) for i in range(N)))
    for i, (_rid, used, ids, _text) in enumerate(results):
        # Each request has its own length: any delta delivered to the wrong stream breaks this.
        assert used == len(ids) == 4 + i, f"request {i}: usage {used}, streamed {len(ids)} ids"
    assert len({r[0] for r in results}) == N
    replicas = Counter()
    for rid, *_ in results:
        rec = await request_record(stack.nats_url, rid)
        replicas[rec["route"][0]] += 1
    assert set(replicas) == set(range(pipeline.stages[0].replicas)), replicas
