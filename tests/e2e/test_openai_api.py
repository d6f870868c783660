"""The OpenAI-compatible API through the whole pipeline, with the official ``openai`` client."""

from __future__ import annotations

import base64
import io
import time
import wave

import httpx
import openai
import pytest

from libs.models.tiny import resolve_model
from tests.bus import completed_record

pytestmark = pytest.mark.e2e

SAMPLE_RATE = 24_000
SAMPLES_PER_CODE = 480


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(pipeline):
    """The thinker's own tokenizer, loaded here with transformers: the reference for ``usage`` and
    for the text of the returned token ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(pipeline.thinker.model))


def chat_prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """Prompt tokens of ``messages`` after the model's chat template (docs/api.md: what ``usage`` counts)."""
    return len(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def text_of(tokenizer, ids: list[int]) -> str:
    """The text vLLM's incremental detokenizer gives for ``ids``: their decode, less the bytes at the
    end that do not form a whole character yet (random tokens of the tiny model sometimes end inside
    one; the detokenizer holds them back, so vLLM's own server returns the text without them).
    Anywhere else every character must be there."""
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def expected_audio_samples(pipeline, completion_tokens: int) -> int:
    """Every thinker token reaches the talker, which makes ``codes_per_token`` codes of it; the
    codec turns each code into 480 samples."""
    return completion_tokens * pipeline.stages[pipeline.speech_stage].codes_per_token * SAMPLES_PER_CODE


def test_models_lists_the_served_model(client, pipeline) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [pipeline.served_model_name]


def test_health_reports_every_stage(stack, pipeline) -> None:
    body = httpx.get(f"{stack.base_url}/health").json()
    assert body["status"] == "ok" and body["bus"] is True and body["orchestrators"] >= 1
    assert body["stages"] == {f"{i}:{s.name}": s.replicas for i, s in enumerate(pipeline.stages)}


def test_chat_non_streaming_text(client, pipeline, tokenizer) -> None:
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    r = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=messages,
        max_tokens=12,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content == text_of(tokenizer, ids)
    assert r.usage.completion_tokens == 12 == len(ids)
    assert r.usage.prompt_tokens == chat_prompt_tokens(tokenizer, messages)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_text_usage_matches_streamed_tokens(client, pipeline, tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    raw = client.chat.completions.with_raw_response.create(
        model=pipeline.served_model_name,
        messages=messages,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    stream = raw.parse()
    text, ids, finish, usage, chunk_ids = [], [], None, None, set()
    for chunk in stream:
        chunk_ids.add(chunk.id)
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            ids.extend((c.model_extra or {}).get("token_ids") or [])
            finish = c.finish_reason or finish
    assert chunk_ids == {raw.headers["x-request-id"]}  # the head names the request too
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == len(ids) == 20
    assert usage.prompt_tokens == chat_prompt_tokens(tokenizer, messages)
    assert "".join(text) == text_of(tokenizer, ids), text


def test_completions_non_streaming_and_streaming(client, pipeline, tokenizer) -> None:
    r = client.completions.create(
        model=pipeline.served_model_name,
        prompt="Once upon a time",
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(tokenizer("Once upon a time").input_ids)  # with its BOS
    stream = client.completions.create(
        model=pipeline.served_model_name,
        prompt="Once upon a time",
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            ids.extend((c.model_extra or {}).get("token_ids") or [])
    assert usage.completion_tokens == len(ids) == 7


def test_chat_audio_non_streaming_is_a_valid_wav_of_the_right_length(client, pipeline, tokenizer) -> None:
    r = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=15,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    message = r.choices[0].message
    audio = message.audio
    assert audio is not None and message.content is None  # docs/api.md: the text is the transcript
    assert audio.transcript == text_of(tokenizer, r.choices[0].model_extra["token_ids"])
    assert audio.id and audio.expires_at > time.time()
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (SAMPLE_RATE, 2, 1)
        frames = w.getnframes()
        pcm = w.readframes(frames)
    assert r.usage.completion_tokens == 15
    assert frames == expected_audio_samples(pipeline, 15)
    assert len(pcm) == 2 * frames and any(pcm)  # not silence


async def test_chat_audio_streaming_pcm_chunks(stack, pipeline) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "Sing."}],
        max_tokens=30,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pcm, transcript, usage, audio_chunks = bytearray(), [], None, 0
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            audio = c.delta.audio  # typed by recent clients (OpenAI's streamed audio shape)
            if audio and audio.data:
                pcm += base64.b64decode(audio.data)
                audio_chunks += 1
            if audio and audio.transcript:
                transcript.append(audio.transcript)
    assert usage.completion_tokens == 30
    assert len(pcm) == 2 * expected_audio_samples(pipeline, 30)
    # 30 tokens x 4 codes = 120 codes, forwarded 25 at a time: more than one chunk streamed.
    assert audio_chunks > 1
    assert "".join(transcript)


async def test_request_record_shows_where_the_request_went(stack, pipeline, client) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        modalities=["text", "audio"],
    )
    r = raw.parse()
    assert raw.headers["x-request-id"] == r.id  # the key of its record, as in every response
    rec = await completed_record(stack.nats_url, r.id)
    entry = pipeline.thinker_stage
    assert len(rec["route"]) == len(pipeline.stages) and rec["entry_stage"] == entry
    assert rec["route"][:entry] == [-1] * entry, "the listener skipped"
    ran = rec["stages"][entry:]
    assert all(s["started_ns"] and s["started_ns"] <= s["done_ns"] for s in ran), rec["stages"]
    assert rec["finish_reason"] == r.choices[0].finish_reason
