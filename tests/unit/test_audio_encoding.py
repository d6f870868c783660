"""The gateway's audio encoders and speed filter, judged by an independent decoder.

Every output is opened by PyAV's demuxer and decoder on the bytes alone (none of the encoding code),
then compared with the input: a 440 Hz sine, frames × 2,048 samples at 24 kHz, pushed in chunks of
uneven size.
"""

from __future__ import annotations

import io
import struct
import wave

import av
import numpy as np
import pytest

from services.gateway.audio import AudioFormat, encode_whole, stream_encoder
from services.gateway.audio_tempo import Tempo

RATE = 24_000
FRAME = 2_048
"""Samples per codec frame of the pipeline's audio (SNAC), the unit of the test signal."""
TONE_HZ = 440.0
CHUNKS = (1_000, 7_001, 333, 4_096, 12_345)
"""Push sizes in samples, cycled: none a multiple of any codec's frame."""
LOSSLESS = (AudioFormat.FLAC, AudioFormat.WAV, AudioFormat.PCM)
LOSSY = (AudioFormat.MP3, AudioFormat.OPUS, AudioFormat.AAC)
CODEC_FRAME = {
    AudioFormat.MP3: 576,  # MPEG-2 Layer III at 24 kHz: one granule
    AudioFormat.OPUS: 480,  # 20 ms
    AudioFormat.AAC: 1_024,
    AudioFormat.FLAC: 2_304,  # FFmpeg's block for 24 kHz (105 ms rounded down to a FLAC block size)
    AudioFormat.WAV: 1,
    AudioFormat.PCM: 1,
}
"""Samples per codec frame at 24 kHz."""
PRIMING = {AudioFormat.MP3: 576 + 529, AudioFormat.AAC: 1_024}
"""Samples of encoder delay a stream's decoder cannot drop: LAME's published 576 + the MP3 decoder's
529, and the AAC encoder's one frame (ADTS has no field for it). Other formats signal or have none."""
HELD_BACK_MAX = {
    AudioFormat.MP3: 4 * 576,  # the granule being filled + LAME's look-ahead (measured 2,065)
    AudioFormat.OPUS: 2 * 480,  # the frame being filled + libopus's 6.5 ms look-ahead (measured 636)
    AudioFormat.AAC: 3 * 1_024,  # the frame being filled + the look-ahead frame + priming frame
    AudioFormat.FLAC: 2_304,  # the block being filled
    AudioFormat.WAV: 0,
    AudioFormat.PCM: 0,
}
"""Input samples a stream may not yet represent after a push."""
FIRST_BYTES_BY = {
    AudioFormat.MP3: 3 * 576,
    AudioFormat.OPUS: 2 * 480,
    AudioFormat.AAC: 3 * 1_024,
    AudioFormat.FLAC: 2_304,
    AudioFormat.WAV: 1,
    AudioFormat.PCM: 1,
}
"""Samples after which a format's first bytes have come out of ``push`` (see audio.py's table)."""


def sine(frames: int, hz: float = TONE_HZ) -> np.ndarray:
    """``frames`` × 2,048 samples of a sine at ``hz`` Hz, 24 kHz, int16 at half scale."""
    t = np.arange(frames * FRAME) / RATE
    return np.round(np.sin(2 * np.pi * hz * t) * 16_000).astype("<i2")


def chunks(samples: np.ndarray) -> list[bytes]:
    """``samples`` cut into the uneven sizes of ``CHUNKS``, as PCM16 bytes."""
    out, start, i = [], 0, 0
    while start < len(samples):
        n = CHUNKS[i % len(CHUNKS)]
        out.append(samples[start : start + n].tobytes())
        start, i = start + n, i + 1
    return out


def stream(fmt: AudioFormat, samples: np.ndarray) -> tuple[bytes, list[bytes]]:
    """The whole streamed file, and what each push returned."""
    enc = stream_encoder(fmt, RATE)
    pushed = [enc.push(c) for c in chunks(samples)]
    return b"".join(pushed) + enc.close(), pushed


class Decoded:
    """A file decoded by PyAV: its native rate and channels, and its samples at 24 kHz (float32)."""

    def __init__(self, data: bytes, fmt: AudioFormat) -> None:
        options = {"sample_rate": str(RATE), "ch_layout": "mono"} if fmt is AudioFormat.PCM else {}
        with av.open(
            io.BytesIO(data), format="s16le" if fmt is AudioFormat.PCM else None, options=options
        ) as c:
            stream = c.streams.audio[0]
            self.rate = stream.codec_context.sample_rate
            self.channels = stream.codec_context.layout.nb_channels
            to_24k = av.AudioResampler(format="flt", layout="mono", rate=RATE)
            native, resampled = [], []
            for frame in c.decode(stream):
                native.append(frame.to_ndarray())
                resampled += [f.to_ndarray()[0] for f in to_24k.resample(frame)]
            resampled += [f.to_ndarray()[0] for f in to_24k.resample(None)]
        self.native = np.concatenate(native, axis=1) if native else np.zeros((1, 0))
        self.samples = np.concatenate(resampled) if resampled else np.zeros(0, np.float32)


def pcm16_of(decoded: Decoded) -> bytes:
    """A lossless decode's samples as PCM16 bytes (its decoder's own s16 output, no conversion)."""
    assert decoded.native.dtype == np.int16, decoded.native.dtype
    return decoded.native[0].astype("<i2").tobytes()


def dominant_hz(x: np.ndarray) -> tuple[float, float]:
    """The strongest frequency of ``x`` (24 kHz) in Hz, and the share of energy within ±20 Hz of it."""
    power = np.abs(np.fft.rfft(x * np.hanning(len(x)))) ** 2
    freqs = np.fft.rfftfreq(len(x), 1 / RATE)
    peak = float(freqs[np.argmax(power)])
    return peak, float(power[np.abs(freqs - peak) <= 20].sum() / power.sum())


def best_correlation(decoded: np.ndarray, ref: np.ndarray, max_lag: int) -> float:
    """The highest Pearson correlation of ``ref`` with ``decoded`` shifted by 0..``max_lag`` samples."""
    return max(
        float(np.corrcoef(decoded[lag : lag + len(ref)], ref)[0, 1])
        for lag in range(max_lag + 1)
        if lag + len(ref) <= len(decoded)
    )


@pytest.mark.parametrize("fmt", list(AudioFormat))
def test_streamed_file_decodes_to_the_input(fmt: AudioFormat) -> None:
    samples = sine(12)
    data, _ = stream(fmt, samples)
    decoded = Decoded(data, fmt)
    # Opus decoders always run at 48 kHz; the stream's OpusHead carries the input rate (RFC 7845).
    assert decoded.rate == (48_000 if fmt is AudioFormat.OPUS else RATE)
    assert decoded.channels == 1
    if fmt is AudioFormat.OPUS:
        head = data.index(b"OpusHead")
        channels, _pre_skip, input_rate = struct.unpack_from("<BHI", data, head + 9)
        assert (channels, input_rate) == (1, RATE)
    extra = len(decoded.samples) - len(samples)
    priming = PRIMING.get(fmt, 0)
    assert priming - CODEC_FRAME[fmt] < extra <= priming + CODEC_FRAME[fmt], extra
    if fmt in LOSSLESS:
        assert pcm16_of(decoded) == samples.tobytes()
        return
    peak, share = dominant_hz(decoded.samples)
    assert abs(peak - TONE_HZ) <= RATE / len(decoded.samples), peak
    assert share > 0.95, share
    assert best_correlation(decoded.samples, samples.astype(np.float32), priming + CODEC_FRAME[fmt]) > 0.98


@pytest.mark.parametrize("fmt", list(AudioFormat))
def test_bytes_come_out_before_close(fmt: AudioFormat) -> None:
    enc = stream_encoder(fmt, RATE)
    n = FIRST_BYTES_BY[fmt]
    parts = [n // 3, n // 3, n - 2 * (n // 3)] if n >= 3 else [n]
    sig = sine(2)
    out, start = b"", 0
    for p in parts:
        out += enc.push(sig[start : start + p].tobytes())
        start += p
    assert out, f"{fmt}: nothing before close after {n} samples"


@pytest.mark.parametrize("fmt", list(AudioFormat))
def test_a_push_holds_back_at_most_a_frame_and_the_look_ahead(fmt: AudioFormat) -> None:
    """After pushing 1.02 s, what came out so far decodes to all of it but the encoder's hold."""
    samples = sine(12)
    _, pushed = stream(fmt, samples)
    so_far = Decoded(b"".join(pushed), fmt)
    represented = len(so_far.samples) - PRIMING.get(fmt, 0)
    assert len(samples) - HELD_BACK_MAX[fmt] <= represented <= len(samples), represented


@pytest.mark.parametrize("fmt", list(AudioFormat))
def test_streamed_decodes_as_the_whole_file(fmt: AudioFormat) -> None:
    samples = sine(6)
    streamed = Decoded(stream(fmt, samples)[0], fmt).native[0]
    whole_bytes = encode_whole(fmt, samples.tobytes(), RATE)
    whole = Decoded(whole_bytes, fmt).native[0]
    if fmt is AudioFormat.MP3:
        # The whole file's Xing/LAME frame makes its decoder drop the priming and the padding; the
        # stream's decoder keeps them. The audio between is the same, sample for sample.
        assert len(whole) == len(samples)
        lag = PRIMING[fmt]
        assert np.array_equal(streamed[lag : lag + len(whole)], whole)
    else:
        assert np.array_equal(streamed, whole)
    if fmt is AudioFormat.WAV:
        with wave.open(io.BytesIO(whole_bytes)) as w:
            assert w.getnframes() == len(samples)
        streamed_bytes = stream(fmt, samples)[0]
        riff_size, data_size = (
            struct.unpack_from("<I", streamed_bytes, 4)[0],
            struct.unpack_from("<I", streamed_bytes, 40)[0],
        )
        assert streamed_bytes[36:40] == b"data" and riff_size == data_size == 0xFFFFFFFF


def test_formats_names_and_content_types() -> None:
    assert AudioFormat.parse("pcm16") is AudioFormat.PCM
    assert {f.value for f in AudioFormat} == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    assert AudioFormat.MP3.content_type == "audio/mpeg"
    assert AudioFormat.OPUS.content_type == "audio/ogg"
    with pytest.raises(ValueError):
        stream_encoder("ogg", RATE)
    with pytest.raises(ValueError, match="22050 Hz"):
        stream_encoder(AudioFormat.OPUS, 22_050)
    with pytest.raises(ValueError, match="whole 2-byte samples"):
        stream_encoder(AudioFormat.MP3, RATE).push(b"\x00\x01\x02")
    assert encode_whole(AudioFormat.PCM, b"\x01\x02", RATE) == b"\x01\x02"


def stretched(speed: float, samples: np.ndarray) -> tuple[np.ndarray, int]:
    """``samples`` through ``Tempo(speed)`` in uneven pushes: all the output, and how many output
    samples the pushes returned before ``close``."""
    tempo = Tempo(speed, RATE)
    pushed = b"".join(tempo.push(c) for c in chunks(samples))
    return np.frombuffer(pushed + tempo.close(), "<i2").astype(np.float64), len(pushed) // 2


@pytest.mark.parametrize("speed", [2.0, 0.25, 4.0, 0.7])
def test_tempo_changes_the_duration_and_keeps_the_pitch(speed: float) -> None:
    samples = sine(24)
    out, before_close = stretched(speed, samples)
    assert abs(len(out) - len(samples) / speed) <= FRAME, len(out)
    peak, share = dominant_hz(out)
    assert abs(peak - TONE_HZ) <= 2 * RATE / len(out), peak
    assert share > 0.9, share
    # Streamed: the pushes' output covers all the input but about an atempo window (1,024) and a fed
    # frame (1,024) per step; 0.25 and 4.0 take two steps (measured: 1,404 input samples at 2.0,
    # 2,430 at 0.25, 4,776 at 4.0).
    assert len(samples) - before_close * speed <= 3 * FRAME, before_close
    if speed == 2.0:
        # The spectrum measure does tell pitches apart: dropping every other sample (a resample to
        # half the duration) doubles the frequency.
        assert dominant_hz(samples[::2].astype(np.float64))[0] == pytest.approx(2 * TONE_HZ, abs=2)


def test_tempo_one_passes_through_and_the_range_is_openais() -> None:
    pcm = sine(1).tobytes()
    tempo = Tempo(1.0, RATE)
    assert tempo.push(pcm) is pcm
    assert tempo.close() == b""
    for bad in (0.2, 4.1, float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match=r"between 0\.25 and 4\.0"):
            Tempo(bad, RATE)
