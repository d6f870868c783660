"""``/v1/audio/speech`` through the whole stack with the official ``openai`` client: every format
decoded by PyAV (not the gateway's encoder) to the length the talker's tokens make, the SSE
events parsed one by one, and the record showing the request entered at the talker; chat
completions' audio formats likewise."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import openai
import pytest

from tests.bus import completed_record
from tests.e2e.test_openai_api import SAMPLE_RATE, expected_audio_samples

pytestmark = pytest.mark.e2e

SENTENCES = ["The tide came in.", "Gulls cried over the harbour!"]
"""The input's sentences: the gateway speaks each as one talker chunk."""
LOSSY_TOLERANCE_S = 0.1
"""A lossy format's decoded length may differ from the audio's by its encoder's priming and last
frame's padding, which a streamed file cannot tell its decoder to drop (docs/audio.md: mp3 up to
~70 ms, AAC ~85 ms at 24 kHz), seconds."""


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected_samples(pipeline) -> int:
    """PCM samples of the input's audio: every token of each sentence (the thinker's tokenizer,
    loaded here) becomes ``codes_per_token`` codes of 480 samples."""
    from transformers import AutoTokenizer

    from libs.models.tiny import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(pipeline.thinker.model))
    tokens = sum(len(tok.encode(s, add_special_tokens=False)) for s in SENTENCES)
    return expected_audio_samples(pipeline, tokens)


def decoded(data: bytes, fmt: str) -> tuple[np.ndarray, int, int]:
    """(mono samples as float, sample rate, channels) of ``data`` decoded by PyAV; ``pcm`` is
    headerless 24 kHz PCM16 and read as such."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, SAMPLE_RATE, 1
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        channels = stream.codec_context.channels
        frames = [f.to_ndarray().reshape(-1, f.samples) for f in container.decode(stream)]
        rate = stream.codec_context.sample_rate
    pcm = np.concatenate(frames, axis=1)
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768
    return pcm[0], rate, channels


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_decodes_to_the_audio_of_the_input(client, pipeline, expected_samples, fmt) -> None:
    response = client.audio.speech.create(
        model=pipeline.served_model_name,
        voice="alloy",
        input=" ".join(SENTENCES),
        response_format=fmt,
    )
    samples, rate, channels = decoded(response.content, fmt)
    assert channels == 1 and np.abs(samples).max() > 0.01, "silence"
    seconds, expected_s = len(samples) / rate, expected_samples / SAMPLE_RATE
    if fmt in ("flac", "wav", "pcm"):
        assert (rate, len(samples)) == (SAMPLE_RATE, expected_samples)
    else:
        assert abs(seconds - expected_s) <= LOSSY_TOLERANCE_S, (seconds, expected_s)


def test_speed_changes_the_length_and_keeps_the_format(client, pipeline, expected_samples) -> None:
    fast = client.audio.speech.create(
        model=pipeline.served_model_name,
        voice="alloy",
        input=" ".join(SENTENCES),
        response_format="wav",
        speed=2.0,
    )
    samples, rate, _ = decoded(fast.content, "wav")
    assert rate == SAMPLE_RATE
    assert abs(len(samples) - expected_samples / 2) <= 1024, (len(samples), expected_samples)


async def test_sse_events_carry_the_file_and_the_usage(stack, pipeline, expected_samples) -> None:
    client = stack.client()
    async with client.audio.speech.with_streaming_response.create(
        model=pipeline.served_model_name,
        voice="alloy",
        input=" ".join(SENTENCES),
        response_format="pcm",
        stream_format="sse",
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        events = [json.loads(line[5:]) async for line in response.iter_lines() if line.startswith("data:")]
    await client.close()
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"}
    assert len(kinds) > 2, "the audio came in one piece: nothing was streamed"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) == 2 * expected_samples
    codes = expected_samples // 480
    tokens = codes // pipeline.stages[pipeline.speech_stage].codes_per_token
    assert events[-1]["usage"] == {
        "input_tokens": tokens,
        "output_tokens": codes,
        "total_tokens": tokens + codes,
    }
    rec = await completed_record(stack.nats_url, request_id)
    entry = pipeline.speech_stage
    assert rec["entry_stage"] == entry and rec["route"][:entry] == [-1] * entry
    assert all(s["attempts"] == [] for s in rec["stages"][:entry]), "the stages before the talker skipped"


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_chat_audio_comes_as_the_whole_file_in_the_asked_format(client, pipeline, fmt) -> None:
    r = client.chat.completions.create(
        model=pipeline.served_model_name,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=15,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": fmt},
        extra_body={"ignore_eos": True},
    )
    samples, rate, channels = decoded(base64.b64decode(r.choices[0].message.audio.data), fmt)
    expected = expected_audio_samples(pipeline, 15)
    assert channels == 1 and np.abs(samples).max() > 0.01, "silence"
    if fmt == "flac":
        assert (rate, len(samples)) == (SAMPLE_RATE, expected)
    else:
        assert abs(len(samples) / rate - expected / SAMPLE_RATE) <= LOSSY_TOLERANCE_S
