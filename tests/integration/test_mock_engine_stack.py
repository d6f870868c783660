"""A real gateway, orchestrator and thinker worker on the mock engine (``engine.mock``), a real
nats-server, and the official openai client: the streamed answer has exactly ``max_tokens``
tokens, and its text is the tiny thinker tokenizer's decode of the tokens the mock engine streams
at those positions (services/stage_worker/mock_engine.py), so every per-token step between the
worker and the client carried each token once and in order. The worker exports omnirelay's
metrics and none of vLLM's engine families (none exist without vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm.tokenizers import get_tokenizer

from libs.common.envelopes import ClientEvent, decode, unpack_batch
from libs.common.subjects import Subjects
from libs.models.tiny import resolve_model
from libs.stack.bus_state import barrier
from services.stage_worker.mock_engine import token_cycle
from tests.pipeline_services import Services
from tests.procs import write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "mockeng"
MOCK_THINKER_YAML = """\
  - name: thinker
    type: llm
    model: tiny-thinker
    replicas: 1
    consumes: text
    emits: text
    stream_to_client: true
    engine: {max_num_seqs: 64, mock: {inter_token_ms: 0}}
"""


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    tmp = tmp_path_factory.mktemp("mockeng")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, MOCK_THINKER_YAML)
    with Services(nats_server.url, path, tmp).start(workers=[(0, 0)]).serving() as services:
        yield services


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(resolve_model("tiny-thinker"))


async def _stream(client: openai.AsyncOpenAI, max_tokens: int, **kw) -> tuple[str, int, int, str | None]:
    """(content, completion tokens, prompt tokens, finish reason) of one streamed chat completion."""
    stream = await client.chat.completions.create(
        model=f"{PIPELINE}-model",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    text, usage, finish = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "include_usage: the last chunk carries the usage"
    return text, usage.completion_tokens, usage.prompt_tokens, finish


def _expected(tokenizer, prompt_tokens: int, n: int) -> str:
    cycle = token_cycle(tokenizer)
    return tokenizer.decode([cycle[(prompt_tokens + k) % len(cycle)] for k in range(n)])


async def test_a_streamed_completion_has_max_tokens_tokens_and_their_text(stack, tokenizer) -> None:
    async with stack.client(60) as client:
        text, completion, prompt, finish = await _stream(client, 37)
    assert completion == 37
    assert finish == "length"
    assert prompt > 0
    assert text == _expected(tokenizer, prompt, 37)


async def test_concurrent_streams_each_get_every_token(stack, tokenizer, nc) -> None:
    """With 24 streams under way, the worker sends a turn's events of several requests in one
    batch (services/stage_worker/event_batcher.py); the gateway unpacks each batch, so every
    stream still gets each of its tokens once, in order."""
    batches: list[list[ClientEvent]] = []

    async def on_batch(msg) -> None:
        batches.append([decode(ClientEvent, b) for b in unpack_batch(msg.data)])

    sub = await nc.subscribe(Subjects(PIPELINE).out_batch("*"), cb=on_batch)
    await barrier(nc)
    async with stack.client(60) as client:
        results = await asyncio.gather(*(_stream(client, 64) for _ in range(24)))
    await sub.unsubscribe()
    assert [r[1] for r in results] == [64] * 24
    assert all(r[0] == _expected(tokenizer, r[2], 64) for r in results)
    assert batches, "no batch: every event went alone"
    assert all(len(b) >= 2 for b in batches)
    assert max(len({e.request_id for e in b}) for b in batches) >= 2, "no batch carried two requests"


async def test_a_stop_string_ends_the_answer(stack) -> None:
    async with stack.client(60) as client:
        free, _, _, _ = await _stream(client, 80)
        word = "ships"
        assert word in free
        text, completion, _, finish = await _stream(client, 80, stop=[word])
    assert finish == "stop"
    assert text == free[: free.index(word)]
    assert completion < 80


async def test_the_worker_exports_omnirelay_metrics_and_no_vllm_engine_families(stack) -> None:
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(stack.worker(0).metrics_url, timeout=5).text)
    }
    vllm_own = [n for n in families if n.startswith("vllm:") and not n.startswith("vllm:omni_")]
    assert not vllm_own, f"vLLM engine families on a mock engine: {vllm_own}"
    engine_procs = [s for n, f in families.items() if n.startswith("vllm:omni_engine_") for s in f.samples]
    assert not engine_procs, "no engine processes exist to report on"
    stage = families["vllm:omni_stage_request_s"]
    count = sum(s.value for s in stage.samples if s.name.endswith("_count"))
    assert count >= 1, "the stage's request time is recorded as with a real engine"
