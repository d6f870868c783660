"""The audio formats of OpenAI's Realtime API, in and out.

A session's ``audio.input.format`` and ``audio.output.format`` name one of three formats, all mono:

==============  =========================================  ===========  ===============
``type``        encoding                                   rate (Hz)    bytes / sample
==============  =========================================  ===========  ===============
``audio/pcm``   PCM16, signed 16-bit little-endian         24,000       2
``audio/pcmu``  G.711 μ-law                                8,000        1
``audio/pcma``  G.711 A-law                                8,000        1
==============  =========================================  ===========  ===============

:class:`InputDecoder` turns a client's bytes into what the speech recognizer and the voice activity
detector take: mono PCM16 little-endian at 16,000 Hz (:data:`INPUT_SAMPLE_RATE`).
:class:`OutputEncoder` turns the pipeline's PCM16 (24,000 Hz from code2wav) into a session's
output format. Both stream: pieces of any size go in, and the output is the same as for the whole
stream pushed at once. Nothing here reads a clock: time is only a count of samples, and
:func:`duration_ms` converts a byte count into milliseconds of audio.

Resampling is PyAV's ``av.AudioResampler`` (FFmpeg's libswresample), which keeps its filter
history from frame to frame. Its output is time-aligned with its input (no phase delay), but it
holds back the last samples its filter needs to look ahead over (16 output samples from 24,000 to
16,000 Hz or 8,000 Hz; 32 from 8,000 to 16,000 Hz, i.e. 1-2 ms) until :meth:`flush`.

G.711 is ITU-T's reference algorithm (G.191's ``g711.c``) as numpy lookup tables built at import:
256 entries to decode, 65,536 (one per 16-bit sample) to encode. FFmpeg's ``pcm_mulaw`` and
``pcm_alaw`` decoders agree on every code; its encoders round to the nearest level where G.711
starts a segment at its edge, so they pick the adjacent level for under 2% of the 16-bit inputs.
"""

from __future__ import annotations

from enum import StrEnum

import av
import numpy as np

from libs.common.envelopes import INPUT_SAMPLE_RATE
from services.gateway.audio import PCM16_WIDTH, check_pcm16, pcm16_frame


class AudioFormatType(StrEnum):
    """The ``type`` of a Realtime session's audio format."""

    PCM = "audio/pcm"
    PCMU = "audio/pcmu"
    PCMA = "audio/pcma"


_RATE_HZ = {AudioFormatType.PCM: 24_000, AudioFormatType.PCMU: 8_000, AudioFormatType.PCMA: 8_000}
_BYTES_PER_SAMPLE = {AudioFormatType.PCM: PCM16_WIDTH, AudioFormatType.PCMU: 1, AudioFormatType.PCMA: 1}


def sample_rate(fmt: AudioFormatType | str) -> int:
    """Samples per second of ``fmt``, Hz (ValueError for an unknown format)."""
    return _RATE_HZ[AudioFormatType(fmt)]


def bytes_per_second(fmt: AudioFormatType | str) -> int:
    """Bytes of ``fmt`` per second of audio."""
    return sample_rate(fmt) * _BYTES_PER_SAMPLE[AudioFormatType(fmt)]


def duration_ms(n_bytes: int, fmt: AudioFormatType | str) -> float:
    """Milliseconds of audio in ``n_bytes`` bytes of ``fmt``."""
    return n_bytes * 1000 / bytes_per_second(fmt)


# --- G.711 ----------------------------------------------------------------------------------------
def _ulaw_encode(x: np.ndarray) -> np.ndarray:
    """μ-law codes of 16-bit samples ``x`` (int32): 14-bit magnitude, biased by 33, in 8 segments."""
    v = x >> 2
    magnitude = np.minimum(np.abs(v), 8159) + 33
    segment = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), magnitude)
    code = (segment << 4) | ((magnitude >> (segment + 1)) & 0xF)
    code = np.where(segment > 7, 0x7F, code)  # only the clipped top: the largest code
    return code ^ np.where(v < 0, 0x7F, 0xFF)  # codes are sent inverted; the sign bit is set for >= 0


def _alaw_encode(x: np.ndarray) -> np.ndarray:
    """A-law codes of 16-bit samples ``x`` (int32): 13-bit magnitude in 8 segments."""
    v = x >> 3
    magnitude = np.where(v < 0, -v - 1, v)
    segment = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), magnitude)
    step_shift = np.maximum(segment, 1)  # segments 0 and 1 share the finest step
    code = np.where(segment > 7, 0x7F, (segment << 4) | ((magnitude >> step_shift) & 0xF))
    return code ^ np.where(v < 0, 0x55, 0xD5)  # even bits inverted; the sign bit is set for >= 0


def _ulaw_decode(code: np.ndarray) -> np.ndarray:
    u = ~code & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84)


def _alaw_decode(code: np.ndarray) -> np.ndarray:
    a = code ^ 0x55
    segment = (a & 0x70) >> 4
    t = (((a & 0x0F) << 4) + np.where(segment == 0, 8, 0x108)) << np.maximum(segment - 1, 0)
    return np.where(a & 0x80, t, -t)


_WORDS = np.arange(1 << 16, dtype=np.uint16).view(np.int16).astype(np.int32)
"""The signed value of every 16-bit word, in the order of the words: encoding indexes by the word."""
_CODES = np.arange(256, dtype=np.int32)
_ENCODE = {
    AudioFormatType.PCMU: _ulaw_encode(_WORDS).astype(np.uint8),
    AudioFormatType.PCMA: _alaw_encode(_WORDS).astype(np.uint8),
}
_DECODE = {
    AudioFormatType.PCMU: _ulaw_decode(_CODES).astype("<i2"),
    AudioFormatType.PCMA: _alaw_decode(_CODES).astype("<i2"),
}


# --- resampling -----------------------------------------------------------------------------------
class _Resampler:
    """Mono PCM16 from ``in_rate`` to ``out_rate`` Hz, streamed; the bytes as they are when equal."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self._in_rate = in_rate
        self._out_rate = out_rate
        self._start()

    def _start(self) -> None:
        self._av = av.AudioResampler(format="s16", layout="mono", rate=self._out_rate)
        self._samples = 0
        """Samples pushed since the start: the next frame's pts."""

    def push(self, pcm16: bytes) -> bytes:
        check_pcm16(pcm16)
        if self._in_rate == self._out_rate or not pcm16:
            return bytes(pcm16)
        frame = pcm16_frame(pcm16, self._in_rate, self._samples)
        self._samples += len(pcm16) // PCM16_WIDTH
        return b"".join(f.to_ndarray().tobytes() for f in self._av.resample(frame))

    def flush(self) -> bytes:
        """The samples held back, ending the stream; the next push starts a new one."""
        if self._in_rate == self._out_rate or not self._samples:
            return b""
        tail = b"".join(f.to_ndarray().tobytes() for f in self._av.resample(None))
        self._start()
        return tail


class InputDecoder:
    """A client's audio in ``fmt`` as mono PCM16 little-endian at 16,000 Hz, push by push."""

    def __init__(self, fmt: AudioFormatType | str) -> None:
        self.format = AudioFormatType(fmt)
        self._resampler = _Resampler(sample_rate(self.format), INPUT_SAMPLE_RATE)
        self._odd_byte = b""
        """``audio/pcm``: the first byte of a sample whose second byte is in the next push."""

    def push(self, data: bytes) -> bytes:
        """The 16 kHz PCM16 that ``data`` completes (a few samples stay held back until flush)."""
        return self._resampler.push(self._pcm16(data))

    def flush(self) -> bytes:
        """The resampler's held-back samples, ending the stream (a dangling half sample is dropped)."""
        self._odd_byte = b""
        return self._resampler.flush()

    def _pcm16(self, data: bytes) -> bytes:
        """``data`` as PCM16 at the format's own rate."""
        if self.format is not AudioFormatType.PCM:
            return _DECODE[self.format][np.frombuffer(data, dtype=np.uint8)].tobytes()
        data = self._odd_byte + data
        whole = len(data) - len(data) % PCM16_WIDTH
        self._odd_byte = data[whole:]
        return data[:whole]


class OutputEncoder:
    """Mono PCM16 little-endian at ``source_rate`` Hz as bytes of ``fmt``, push by push."""

    def __init__(self, fmt: AudioFormatType | str, source_rate: int = 24_000) -> None:
        self.format = AudioFormatType(fmt)
        self._resampler = _Resampler(source_rate, sample_rate(self.format))

    def push(self, pcm16: bytes) -> bytes:
        """The bytes of ``fmt`` for ``pcm16`` (whole samples; ValueError otherwise)."""
        return self._encode(self._resampler.push(pcm16))

    def flush(self) -> bytes:
        """The bytes of the samples the resampler held back, ending the stream."""
        return self._encode(self._resampler.flush())

    def _encode(self, pcm16: bytes) -> bytes:
        if self.format is AudioFormatType.PCM:
            return pcm16
        return _ENCODE[self.format][np.frombuffer(pcm16, dtype="<u2")].tobytes()
