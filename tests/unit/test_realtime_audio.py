"""The Realtime API's audio formats (services/gateway/realtime/audio_formats.py), judged against
FFmpeg's own G.711 codecs (through PyAV) and against numpy's analysis of a known sine."""

from __future__ import annotations

import av
import numpy as np
import pytest

from services.gateway.realtime.audio_formats import (
    _DECODE,
    AudioFormatType,
    InputDecoder,
    OutputEncoder,
    bytes_per_second,
    duration_ms,
    sample_rate,
)

G711 = {AudioFormatType.PCMU: "pcm_mulaw", AudioFormatType.PCMA: "pcm_alaw"}
MAX_HELD_BACK = 32
"""Most 16 kHz samples the resampler holds until flush (32 from 8 kHz, 16 from 24 kHz): 2 ms."""


def ffmpeg_codec(name: str, mode: str) -> av.CodecContext:
    codec = av.CodecContext.create(name, mode)
    codec.sample_rate, codec.layout = 8_000, "mono"
    if mode == "w":
        codec.format = "s16"
    return codec


def ffmpeg_encode(name: str, samples: np.ndarray) -> bytes:
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate, frame.pts = 8_000, 0
    codec = ffmpeg_codec(name, "w")
    return b"".join(bytes(p) for p in [*codec.encode(frame), *codec.encode(None)])


def sine(hz: float, rate: int, seconds: float, amplitude: np.ndarray | float) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate)).astype("<i2")


def pushed_in_pieces(coder: InputDecoder | OutputEncoder, data: bytes, seed: int) -> bytes:
    """``data`` through ``coder`` in pieces of random sizes up to 3,000 bytes (odd ones too for a
    decoder; whole samples for an encoder, which takes nothing else)."""
    step = 1 if isinstance(coder, InputDecoder) else 2
    rng, out, at = np.random.default_rng(seed), bytearray(), 0
    while at < len(data):
        size = step * int(rng.integers(1, 3_000 // step))
        out += coder.push(data[at : at + size])
        at += size
    return bytes(out + coder.flush())


@pytest.mark.parametrize("fmt", list(G711))
def test_g711_agrees_with_ffmpeg_within_one_level(fmt: AudioFormatType) -> None:
    """Decoding: every code as FFmpeg decodes it. Encoding: a 1 kHz sine whose amplitude rises
    from 0 to full scale (so it crosses every level), as FFmpeg encodes it but where FFmpeg rounds
    to the nearest level and G.711 to the segment's edge: then the adjacent level."""
    decoded = ffmpeg_codec(G711[fmt], "r").decode(av.Packet(bytes(range(256))))
    assert np.array_equal(_DECODE[fmt], np.concatenate([f.to_ndarray().ravel() for f in decoded]))

    samples = sine(1_000, 8_000, 2.0, np.linspace(0, 32_767, 16_000))
    ours = np.frombuffer(OutputEncoder(fmt, source_rate=8_000).push(samples.tobytes()), np.uint8)
    theirs = np.frombuffer(ffmpeg_encode(G711[fmt], samples), np.uint8)
    levels = np.unique(_DECODE[fmt])
    steps = np.searchsorted(levels, _DECODE[fmt][ours]) - np.searchsorted(levels, _DECODE[fmt][theirs])
    assert np.abs(steps).max() <= 1
    assert np.count_nonzero(steps) < 0.02 * len(samples)  # measured: 117 (0.7%, μ-law), 222 (1.4%, A-law)


@pytest.mark.parametrize("fmt", list(AudioFormatType))
def test_a_stream_in_pieces_decodes_as_a_whole(fmt: AudioFormatType) -> None:
    """One second of noise in ``fmt``: 16,000 samples at 16 kHz, whether pushed whole or in pieces."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, bytes_per_second(fmt), dtype=np.uint8).tobytes()
    assert duration_ms(len(data), fmt) == 1_000.0

    whole = InputDecoder(fmt)
    first = whole.push(data)
    assert 16_000 - MAX_HELD_BACK <= len(first) // 2 < 16_000
    at_once = np.frombuffer(first + whole.flush(), "<i2")
    in_pieces = np.frombuffer(pushed_in_pieces(InputDecoder(fmt), data, seed=3), "<i2")
    assert len(at_once) == len(in_pieces) == 16_000
    assert np.abs(at_once.astype(np.int32) - in_pieces).max() <= 1


@pytest.mark.parametrize("fmt", list(G711))
def test_an_output_stream_in_pieces_encodes_as_a_whole(fmt: AudioFormatType) -> None:
    pcm = np.random.default_rng(5).integers(-20_000, 20_000, 24_000, dtype=np.int16).astype("<i2").tobytes()
    whole = OutputEncoder(fmt)
    assert pushed_in_pieces(OutputEncoder(fmt), pcm, seed=4) == whole.push(pcm) + whole.flush()


def sine_fit(x: np.ndarray, hz: float, rate: int, start: int) -> tuple[float, float]:
    """The best-fitting ``hz`` sine (any phase, plus DC) to ``x``, whose first sample is sample
    ``start`` of the stream: its power over that of what remains (dB), and its lag behind a sine of
    phase 0 at the stream's first sample (samples)."""
    t = np.arange(start, start + len(x)) / rate
    basis = np.stack([np.sin(2 * np.pi * hz * t), np.cos(2 * np.pi * hz * t), np.ones_like(t)], axis=1)
    coefficients, *_ = np.linalg.lstsq(basis, x, rcond=None)
    fit = basis[:, :2] @ coefficients[:2]
    snr_db = 10 * np.log10(np.sum(fit**2) / np.sum((x - basis @ coefficients) ** 2))
    return float(snr_db), float(-np.arctan2(coefficients[1], coefficients[0]) / (2 * np.pi * hz) * rate)


@pytest.mark.parametrize("fmt", list(G711))
def test_a_sine_survives_g711_out_and_back(fmt: AudioFormatType) -> None:
    """440 Hz at half scale: 24 kHz → 8 kHz → G.711 → decoded → 16 kHz, pushed in pieces."""
    tone = sine(440, 24_000, 1.0, 16_384).tobytes()
    sent = pushed_in_pieces(OutputEncoder(fmt), tone, seed=1)
    assert len(sent) == 8_000 and sample_rate(fmt) == 8_000
    heard = np.frombuffer(pushed_in_pieces(InputDecoder(fmt), sent, seed=2), "<i2").astype(np.float64)
    assert len(heard) == 16_000

    spectrum = np.abs(np.fft.rfft(heard * np.hanning(len(heard))))
    assert abs(np.fft.rfftfreq(len(heard), 1 / 16_000)[np.argmax(spectrum)] - 440) <= 5
    snr_db, lag = sine_fit(heard[800:-800], 440, 16_000, start=800)  # the first and last 50 ms left out
    assert snr_db > 30  # measured: 37.1 dB (μ-law), 38.5 dB (A-law)
    assert abs(lag) < 0.1  # both resamplers keep time: measured 0.000 samples


def test_pcm_out_at_24_khz_is_its_input() -> None:
    encoder = OutputEncoder(AudioFormatType.PCM)
    pieces = [sine(440, 24_000, 0.01 * n, 9_000).tobytes() for n in (1, 3, 7)]
    assert [encoder.push(p) for p in pieces] == pieces
    assert encoder.flush() == b""
