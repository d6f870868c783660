"""``omnirelay bench-speech``'s accounting: per-request TTFP and RTF, the percentiles of a level
(checked against numpy's percentile, an independent implementation), and how a streamed reply
made of real ``openai`` chunk objects is counted. No servers."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
from openai.types.chat import ChatCompletionChunk

from benchmarks.speech_latency import SpeechTiming, render, speech_request, summarize

RATE = 24_000
FRAME = 2_048


def timing(ttfp_s: float, last_s: float, samples: int, error: str | None = None) -> SpeechTiming:
    """A request sent at t = 100 s whose first audio came ``ttfp_s`` and last ``last_s`` later."""
    return SpeechTiming(100.0, 100.0 + last_s + 0.01, 100.0 + ttfp_s, 100.0 + last_s, samples, RATE, error)


def test_request_ttfp_audio_and_rtf_from_the_definitions() -> None:
    t = timing(ttfp_s=0.25, last_s=1.5, samples=3 * RATE)  # 3 s of audio, last byte 1.5 s after send
    assert t.ok
    assert t.ttfp_s == pytest.approx(0.25)
    assert t.audio_s == pytest.approx(3.0)
    assert t.rtf == pytest.approx(0.5)


def test_failed_request_has_no_ttfp_or_rtf() -> None:
    assert timing(0.2, 1.0, RATE, error="APIError: boom").ttfp_s is None
    no_audio = SpeechTiming(1.0, 2.0, None, None, 0, RATE)
    assert not no_audio.ok and no_audio.rtf is None


def test_level_percentiles_match_numpy_over_successful_requests_only() -> None:
    rng = np.random.default_rng(7)
    ttfp = rng.uniform(0.05, 2.0, 23)
    audio_s = rng.uniform(1.0, 6.0, 23)
    last = ttfp + rng.uniform(0.1, 3.0, 23)
    good = [timing(a, b, round(s * RATE)) for a, b, s in zip(ttfp, last, audio_s, strict=True)]
    bad = [
        timing(0.01, 0.02, RATE, error="APITimeoutError: x"),
        SpeechTiming(100.0, 101.0, None, None, 0, RATE),
    ]
    r = summarize(4, bad[:1] + good + bad[1:], wall_s=12.5)

    samples = np.round(audio_s * RATE) / RATE
    rtf = last / samples
    assert (r.concurrency, r.requests, r.failed, r.wall_s) == (4, 25, 2, 12.5)
    assert r.ttfp_p50_s == pytest.approx(np.percentile(ttfp, 50))
    assert r.ttfp_p99_s == pytest.approx(np.percentile(ttfp, 99))
    assert r.rtf_p50 == pytest.approx(np.percentile(rtf, 50))
    assert r.rtf_p99 == pytest.approx(np.percentile(rtf, 99))
    assert r.audio_mean_s == pytest.approx(samples.mean())
    assert r.first_error == "APITimeoutError: x"


def test_level_with_no_success_is_an_error_naming_the_cause() -> None:
    with pytest.raises(ValueError, match=r"c=16: no request succeeded .*refused"):
        summarize(16, [timing(0.1, 0.2, RATE, error="APIConnectionError: refused")], wall_s=1.0)


def test_render_has_one_row_per_level_in_ms() -> None:
    r = summarize(1, [timing(0.1234, 1.0, 2 * RATE)], wall_s=3.0)
    row = render([r]).splitlines()[2]
    assert row.startswith("| 1 | 1 | 0 | 123 | 123 | 0.500 | 0.500 | 2.00 | 3.0 |")


class _Stream:
    """An async iterator over chunk objects, as the openai client's stream yields them."""

    def __init__(self, chunks: list[ChatCompletionChunk]) -> None:
        self._chunks = iter(chunks)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None


class _Client:
    """Stands in for ``openai.AsyncOpenAI``: ``chat.completions.create`` returns a stream of the
    given chunks and remembers its arguments."""

    def __init__(self, deltas: list[dict]) -> None:
        self.kwargs: dict = {}
        self._chunks = [
            ChatCompletionChunk.model_validate(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "orpheus-tiny",
                    "choices": [{"index": 0, "delta": d, "finish_reason": None}],
                }
            )
            for d in deltas
        ]
        self.chat = self
        self.completions = self

    async def create(self, **kwargs) -> _Stream:
        self.kwargs = kwargs
        return _Stream(self._chunks)


def _pcm(samples: int) -> str:
    return base64.b64encode(np.arange(samples, dtype="<i2").tobytes()).decode()


async def test_streamed_reply_counts_audio_samples_and_asks_for_pcm16() -> None:
    deltas = [
        {"role": "assistant", "content": ""},
        {"audio": {"id": "a", "transcript": "Hello"}},  # text only: not audio
        {"audio": {"id": "a", "data": _pcm(3 * FRAME)}},
        {"audio": {"id": "a", "data": _pcm(FRAME)}},
        {},
    ]
    client = _Client(deltas)
    t = await speech_request(client, "orpheus-tiny", "hi", 8, "tara", RATE, FRAME)
    assert t.ok, t.error
    assert t.samples == 4 * FRAME
    assert t.audio_s == pytest.approx(4 * FRAME / RATE)
    assert t.sent_s <= t.first_audio_s <= t.last_audio_s <= t.done_s
    assert client.kwargs["modalities"] == ["text", "audio"]
    assert client.kwargs["audio"] == {"voice": "tara", "format": "pcm16"}
    assert client.kwargs["stream"] is True


async def test_audio_that_is_not_whole_frames_fails_the_request() -> None:
    client = _Client([{"audio": {"id": "a", "data": _pcm(FRAME + 100)}}])
    t = await speech_request(client, "orpheus-tiny", "hi", 8, "tara", RATE, FRAME)
    assert not t.ok
    assert "not whole frames of 2048 samples" in t.error


async def test_a_stream_that_breaks_is_recorded_not_raised() -> None:
    class Broken(_Client):
        async def create(self, **kwargs) -> _Stream:
            raise ConnectionError("reset by peer")

    t = await speech_request(Broken([]), "orpheus-tiny", "hi", 8, "tara", RATE, FRAME)
    assert not t.ok and t.error == "ConnectionError: reset by peer"
    assert math.isclose(t.audio_s, 0.0)
