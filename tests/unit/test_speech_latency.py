"""``omnirelay bench speech``'s accounting: per-request TTFP and RTF, the percentiles of a level
(checked against numpy's percentile, an independent implementation), how a streamed chat reply
made of real ``openai`` chunk objects is counted, and, for the speech API, the audio seconds of
a body (files made by the gateway's own encoders for a known number of samples) and a streamed
response through the real ``openai`` client over an in-process HTTP transport. No servers."""

from __future__ import annotations

import base64
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from benchmarks.speech_latency import (
    SPEECH_FORMATS,
    SpeechTiming,
    audio_seconds,
    parse_formats,
    render,
    speech_api_request,
    speech_blocks,
    speech_request,
    summarize,
    with_audio,
)
from services.gateway.audio import encode_whole, stream_encoder

RATE = 24_000
FRAME = 2_048


def timing(ttfp_s: float, last_s: float, samples: int, error: str | None = None) -> SpeechTiming:
    """A request sent at t = 100 s whose first audio came ``ttfp_s`` and last ``last_s`` later,
    with ``samples`` at 24 kHz."""
    return SpeechTiming(100.0, 100.0 + last_s + 0.01, 100.0 + ttfp_s, 100.0 + last_s, samples / RATE, error)


def test_request_ttfp_audio_and_rtf_from_the_definitions() -> None:
    t = timing(ttfp_s=0.25, last_s=1.5, samples=3 * RATE)  # 3 s of audio, last byte 1.5 s after send
    assert t.ok
    assert t.ttfp_s == pytest.approx(0.25)
    assert t.audio_s == pytest.approx(3.0)
    assert t.rtf == pytest.approx(0.5)


def test_failed_request_has_no_ttfp_or_rtf() -> None:
    assert timing(0.2, 1.0, RATE, error="APIError: boom").ttfp_s is None
    no_audio = SpeechTiming(1.0, 2.0, None, None, 0.0)
    assert not no_audio.ok and no_audio.rtf is None


def test_level_percentiles_match_numpy_over_successful_requests_only() -> None:
    rng = np.random.default_rng(7)
    ttfp = rng.uniform(0.05, 2.0, 23)
    audio_s = rng.uniform(1.0, 6.0, 23)
    last = ttfp + rng.uniform(0.1, 3.0, 23)
    good = [timing(a, b, round(s * RATE)) for a, b, s in zip(ttfp, last, audio_s, strict=True)]
    bad = [
        timing(0.01, 0.02, RATE, error="APITimeoutError: x"),
        SpeechTiming(100.0, 101.0, None, None, 0.0),
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


# --- the speech API ---------------------------------------------------------------------------

SIGNAL_SAMPLES = 12 * FRAME
"""A known length: 12 SNAC frames, 1.024 s at 24 kHz."""
PRIMING_AND_FRAME = {"mp3": 576 + 529 + 576, "aac": 1_024 + 1_024}
"""Samples a streamed mp3/AAC may decode to beyond its input: the encoder delay its stream cannot
signal (LAME's published 576 + the decoder's 529; AAC's one frame, which ADTS has no field for)
plus the last frame's padding (576 samples for MPEG-2 Layer III at 24 kHz, 1,024 for AAC)."""


def signal() -> bytes:
    """``SIGNAL_SAMPLES`` of a 440 Hz sine at half scale, PCM16."""
    t = np.arange(SIGNAL_SAMPLES) / RATE
    return (np.sin(2 * np.pi * 440.0 * t) * 16_000).astype("<i2").tobytes()


def streamed(fmt: str, pcm: bytes) -> list[bytes]:
    """``pcm`` through the gateway's stream encoder in uneven pushes: the pieces of a body."""
    enc = stream_encoder(fmt, RATE)
    cuts = [0, 1_000 * 2, 7_001 * 2, 15_000 * 2, len(pcm)]
    return [enc.push(pcm[a:b]) for a, b in itertools.pairwise(cuts)] + [enc.close()]


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_a_whole_file_lasts_the_samples_it_was_made_of(fmt: str) -> None:
    seconds = audio_seconds(fmt, encode_whole(fmt, signal(), RATE), RATE)
    if fmt == "aac":  # ADTS: the priming frame and the last frame's padding decode too
        assert SIGNAL_SAMPLES <= round(seconds * RATE) <= SIGNAL_SAMPLES + PRIMING_AND_FRAME[fmt]
    else:  # exact: raw, lossless, Ogg's pre-skip and granule, the mp3's Xing/LAME frame
        assert round(seconds * RATE) == SIGNAL_SAMPLES, seconds


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_a_streamed_body_lasts_its_samples_plus_at_most_the_unsignalled_priming(fmt: str) -> None:
    seconds = audio_seconds(fmt, b"".join(streamed(fmt, signal())), RATE)
    extra = round(seconds * RATE) - SIGNAL_SAMPLES
    assert 0 <= extra <= PRIMING_AND_FRAME.get(fmt, 0), extra


@pytest.mark.parametrize(
    ("fmt", "body"),
    [
        ("pcm", b"\x01\x02\x03"),  # half a sample
        ("pcm", b""),
        ("mp3", b""),
        ("mp3", b"\x00" * 1_000),
        ("flac", b"\x00" * 1_000),
        ("opus", b"OggS" + b"\x00" * 200),
        ("aac", b"\xff\xf1" + b"\x00" * 200),
        ("wav", encode_whole("wav", np.zeros(FRAME, "<i2").tobytes(), RATE)[:40]),  # header cut
        ("flac", encode_whole("wav", np.zeros(FRAME, "<i2").tobytes(), RATE)),  # not the asked format
    ],
)
def test_a_body_that_does_not_decode_is_a_value_error(fmt: str, body: bytes) -> None:
    with pytest.raises(ValueError, match=f"{fmt} body of {len(body)} bytes"):
        audio_seconds(fmt, body, RATE)


def test_formats_are_parsed_in_order_and_checked() -> None:
    assert parse_formats("pcm, mp3,opus") == ("pcm", "mp3", "opus")
    assert set(parse_formats(",".join(SPEECH_FORMATS))) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    for bad, why in [("pcm,ogg", "'ogg' is not one of"), ("", "'' is not one of"), ("mp3,mp3", "twice")]:
        with pytest.raises(ValueError, match=why):
            parse_formats(bad)


class _SpeechServer:
    """An in-process stand-in for the gateway's speech route under the real ``openai`` client:
    answers ``pieces`` as a streamed body, noting the request and when each piece was handed over
    (``time.perf_counter()``; a piece is produced only once the client asks for more)."""

    def __init__(self, pieces: list[bytes], status: int = 200) -> None:
        self.pieces = pieces
        self.status = status
        self.request: httpx.Request | None = None
        self.handed: list[float] = []

    async def _body(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            self.handed.append(time.perf_counter())
            yield piece

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.request = request
        if self.status != 200:
            error = {"message": "bad voice", "type": "invalid_request_error", "param": "voice", "code": "x"}
            return httpx.Response(self.status, json={"error": error})
        return httpx.Response(200, content=self._body(), headers={"content-type": "audio/mpeg"})

    def client(self) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.MockTransport(self))
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", max_retries=0, http_client=http)


async def test_a_streamed_speech_body_is_timed_per_piece_and_decoded_after() -> None:
    pieces = [p for p in streamed("mp3", signal()) if p]
    assert len(pieces) >= 3, "the encoder gave too few pieces to time"
    server = _SpeechServer(pieces)
    got = await speech_api_request(server.client(), "orpheus-tiny", "The tide came in.", "tara", "mp3")

    assert server.request is not None and server.request.url.path == "/v1/audio/speech"
    assert json.loads(server.request.content) == {
        "model": "orpheus-tiny",
        "voice": "tara",
        "input": "The tide came in.",
        "response_format": "mp3",
    }
    assert got.body == b"".join(pieces)
    t = got.timing
    assert t.error is None and t.audio_s == 0.0, "decoded inside the timed request"
    # The first piece's arrival is read before the second is produced; the last's after it was.
    assert t.sent_s <= server.handed[0] <= t.first_audio_s < server.handed[1]
    assert server.handed[-1] <= t.last_audio_s <= t.done_s

    done = with_audio("mp3", got, RATE, FRAME)
    assert done.ok, done.error
    assert SIGNAL_SAMPLES <= round(done.audio_s * RATE) <= SIGNAL_SAMPLES + PRIMING_AND_FRAME["mp3"]
    assert done.rtf == pytest.approx((t.last_audio_s - t.sent_s) / done.audio_s)
    assert done.ttfp_s == pytest.approx(t.first_audio_s - t.sent_s)


async def test_pcm_is_counted_from_its_bytes_and_must_be_whole_frames() -> None:
    pcm = signal()
    got = await speech_api_request(
        _SpeechServer([pcm[:5_000], pcm[5_000:]]).client(), "m", "x", "tara", "pcm"
    )
    assert with_audio("pcm", got, RATE, FRAME).audio_s == pytest.approx(SIGNAL_SAMPLES / RATE)

    short = await speech_api_request(_SpeechServer([pcm[: -2 * 100]]).client(), "m", "x", "tara", "pcm")
    t = with_audio("pcm", short, RATE, FRAME)
    assert not t.ok and "not whole frames of 2048 samples" in t.error


async def test_a_body_that_does_not_decode_fails_the_request() -> None:
    got = await speech_api_request(_SpeechServer([b"\x00" * 4_000]).client(), "m", "x", "tara", "aac")
    assert got.timing.error is None  # it arrived: only the decode can tell
    t = with_audio("aac", got, RATE, FRAME)
    assert not t.ok and t.rtf is None and "aac body of 4000 bytes" in t.error


async def test_an_http_error_is_recorded_not_raised() -> None:
    server = _SpeechServer([], status=400)
    got = await speech_api_request(server.client(), "m", "x", "nobody", "wav")
    t = with_audio("wav", got, RATE, FRAME)
    assert not t.ok and t.error.startswith("BadRequestError") and "bad voice" in t.error


def test_speech_levels_render_with_a_format_column_and_the_gateway_cpu() -> None:
    pcm = replace(summarize(16, [timing(0.25, 2.0, 4 * RATE)], wall_s=9.0, fmt="pcm"), gateway_cpu_pct=12.34)
    mp3 = summarize(
        16, [timing(0.3, 2.0, 4 * RATE), timing(0.1, 0.2, RATE, error="ValueError: x")], wall_s=9.5, fmt="mp3"
    )
    lines = render([pcm, mp3]).splitlines()
    assert lines[0].startswith("| concurrency | format | requests | failed | TTFB p50, ms |")
    assert lines[0].endswith("| level wall, s | gateway CPU, % of a core |")
    assert lines[1].split("|")[2].strip() == "---"
    assert lines[2] == "| 16 | pcm | 1 | 0 | 250 | 250 | 0.500 | 0.500 | 4.00 | 9.0 | 12 |"
    assert lines[3] == "| 16 | mp3 | 2 | 1 | 300 | 300 | 0.500 | 0.500 | 4.00 | 9.5 |  |"
    assert lines[4] == "c=16 mp3: first failure: ValueError: x"
    with pytest.raises(ValueError, match=r"c=1 opus: no request succeeded \(ValueError: y\)"):
        summarize(1, [timing(0.1, 0.2, RATE, error="ValueError: y")], wall_s=1.0, fmt="opus")


def test_the_chat_table_keeps_its_columns() -> None:
    header = render([summarize(4, [timing(0.1, 1.0, RATE)], wall_s=2.0)]).splitlines()[0]
    assert header == (
        "| concurrency | requests | failed | TTFP p50, ms | TTFP p99, ms | RTF p50 | RTF p99 "
        "| audio per request, s | level wall, s |"
    )


def test_speech_formats_take_turns_in_blocks_of_the_concurrency() -> None:
    assert speech_blocks(5, 2, ["pcm", "mp3"]) == [
        ("pcm", 0, 2),
        ("mp3", 0, 2),
        ("pcm", 2, 2),
        ("mp3", 2, 2),
        ("pcm", 4, 1),
        ("mp3", 4, 1),
    ]
    blocks = speech_blocks(16, 16, SPEECH_FORMATS)
    assert [(fmt, n) for fmt, _, n in blocks] == [(fmt, 16) for fmt in SPEECH_FORMATS]
    for fmt in SPEECH_FORMATS:  # every format: every request once, one at a time at concurrency 1
        firsts = [first for f, first, n in speech_blocks(7, 1, SPEECH_FORMATS) if f == fmt]
        assert firsts == list(range(7))
