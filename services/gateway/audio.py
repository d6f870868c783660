"""Audio for the API: PCM16 mono into OpenAI's six formats, streamed as it is produced or whole.

The pipeline's audio is PCM16 (signed 16-bit little-endian), mono, at the codec's rate (24,000 Hz
for the shipped codecs). ``stream_encoder`` turns it into a format's bytes push by push;
``encode_whole`` makes one file. Codecs and containers are FFmpeg's, through PyAV (``av``), whose
wheel bundles them (libmp3lame, libopus, FFmpeg's native AAC and FLAC encoders): no external binary.

Where each format's bytes come out (at 24,000 Hz; a frame is the codec's unit of samples):

========  =========================  ===================================================================
format    container, codec           first bytes, and what a push holds back
========  =========================  ===================================================================
mp3       MPEG audio frames, LAME    after ~1,200 samples (two 576-sample frames and LAME's look-ahead);
                                     holds back < 2,304 (bit reservoir off: each frame leaves at once)
opus      Ogg, libopus               the headers and first page after 480 samples plus libopus's
                                     look-ahead (156); one Ogg page per 20 ms packet
aac       ADTS, FFmpeg's AAC         after 2,048 samples (a 1,024-sample frame and its look-ahead frame);
                                     each ADTS frame stands alone
flac      native FLAC                STREAMINFO at the first block (2,304 samples); holds back < 1 block
wav       RIFF/WAVE, PCM16           the 44-byte header and the samples of the first push
pcm       none                       every push's bytes as they are
========  =========================  ===================================================================

A streamed WAV's RIFF and data sizes are 0xFFFFFFFF (FFmpeg's convention for an unseekable output;
decoders read to the end of the stream); ``encode_whole`` writes the exact sizes, and for mp3 a
Xing/LAME frame that tells decoders the encoder's delay and padding (a stream cannot: its first
frames are sent before they are known), so a streamed mp3 decodes with ~1,105 samples of leading
silence more, as does ADTS AAC with 1,024 (ADTS has no field for it). Ogg/Opus's pre-skip and
FLAC's block sizes make theirs exact.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import av
import numpy as np

PCM16_WIDTH = 2
"""Bytes per sample of PCM16."""


class AudioFormat(StrEnum):
    """OpenAI's speech ``response_format`` values (chat completions' ``pcm16`` is ``PCM``)."""

    MP3 = "mp3"
    OPUS = "opus"
    AAC = "aac"
    FLAC = "flac"
    WAV = "wav"
    PCM = "pcm"

    @classmethod
    def parse(cls, name: str) -> AudioFormat:
        """The format named ``name``, accepting chat completions' ``pcm16``; ValueError otherwise."""
        return cls.PCM if name == "pcm16" else cls(name)

    @property
    def content_type(self) -> str:
        """The HTTP ``Content-Type`` of this format's bytes."""
        return _CONTENT_TYPES[self]

    @property
    def extension(self) -> str:
        """The usual file name extension, without the dot."""
        return self.value


_CONTENT_TYPES = {
    AudioFormat.MP3: "audio/mpeg",
    # Ogg/Opus is a file in an Ogg container (RFC 7845 registers audio/ogg for it); audio/opus is
    # the RTP payload type (RFC 7587). Players and browsers recognise audio/ogg.
    AudioFormat.OPUS: "audio/ogg",
    AudioFormat.AAC: "audio/aac",
    AudioFormat.FLAC: "audio/flac",
    AudioFormat.WAV: "audio/wav",
    AudioFormat.PCM: "audio/pcm",
}


@dataclass(frozen=True)
class _Codec:
    """How one format is made with FFmpeg: muxer, encoder, bit rate (bits/s) and their options."""

    muxer: str
    encoder: str
    bit_rate: int = 0
    encoder_options: dict[str, str] = field(default_factory=dict)
    muxer_options: dict[str, str] = field(default_factory=dict)


_CODECS = {
    # id3v2_version 0: no ID3 tag, the stream is MPEG frames only. reservoir 0: no bit reservoir,
    # so a frame does not wait for later frames' spare bits (about 2,300 samples less held back).
    AudioFormat.MP3: _Codec("mp3", "libmp3lame", 64_000, {"reservoir": "0"}, {"id3v2_version": "0"}),
    # page_duration (µs): an Ogg page per 20 ms Opus packet, so each packet leaves when it is made
    # (the page headers cost ~11 kbit/s on top of the codec's 32).
    AudioFormat.OPUS: _Codec("ogg", "libopus", 32_000, muxer_options={"page_duration": "20000"}),
    AudioFormat.AAC: _Codec("adts", "aac", 64_000),
    # metadata_header_padding 0: no 8 KiB PADDING block ahead of the first audio.
    AudioFormat.FLAC: _Codec("flac", "flac", muxer_options={"metadata_header_padding": "0"}),
    AudioFormat.WAV: _Codec("wav", "pcm_s16le"),
}

_COMMON_MUXER_OPTIONS = {
    "flush_packets": "1",  # hand every packet to the sink at once (no 32 KiB I/O buffer)
    "fflags": "+bitexact",  # no encoder-version tags, deterministic Ogg serial numbers
}


class _Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...


class _Drain:
    """An unseekable in-memory sink: what the muxer wrote since the last ``take``.

    Having no ``seek``, it tells FFmpeg the output is a stream: nothing is rewritten afterwards.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes, /) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        """The bytes written since the last call, removed from the sink."""
        out = bytes(self._buf)
        self._buf.clear()
        return out


def check_pcm16(pcm16: bytes | memoryview) -> None:
    """ValueError unless ``pcm16`` is whole 2-byte samples."""
    if len(pcm16) % PCM16_WIDTH:
        raise ValueError(f"PCM16 audio must be whole 2-byte samples, got {len(pcm16)} bytes")


def pcm16_frame(pcm16: bytes | memoryview, sample_rate_hz: int, first_sample: int) -> av.AudioFrame:
    """A mono s16 frame of ``pcm16`` (non-empty) whose pts is ``first_sample`` (in samples)."""
    check_pcm16(pcm16)
    samples = np.frombuffer(pcm16, dtype="<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = sample_rate_hz
    frame.pts = first_sample
    return frame


class _Muxer:
    """One FFmpeg encoder and muxer writing ``fmt`` for mono PCM16 at ``sample_rate_hz`` to ``sink``."""

    def __init__(self, fmt: AudioFormat, sample_rate_hz: int, sink: _Sink) -> None:
        codec = _CODECS[fmt]
        self._rate = sample_rate_hz
        self._samples = 0
        self._container = av.open(
            sink, mode="w", format=codec.muxer, options={**_COMMON_MUXER_OPTIONS, **codec.muxer_options}
        )
        self._stream = self._container.add_stream(
            codec.encoder, rate=sample_rate_hz, layout="mono", options=dict(codec.encoder_options)
        )
        if codec.bit_rate:
            self._stream.codec_context.bit_rate = codec.bit_rate
        try:
            self._stream.codec_context.open()
        except av.FFmpegError as e:
            self._container.close()
            raise ValueError(f"{fmt} cannot encode {sample_rate_hz} Hz audio ({codec.encoder}: {e})") from e

    def write(self, pcm16: bytes) -> None:
        """Encode ``pcm16`` (whole samples) and mux the packets the encoder has ready."""
        frame = pcm16_frame(pcm16, self._rate, self._samples)
        self._samples += frame.samples
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def finish(self) -> None:
        """Drain the encoder, write the trailer (and, on a seekable sink, the fixed-up header)."""
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        if not self._samples:
            self._container.start_encoding()  # the header alone: a valid empty file where one exists
        self._container.close()


class StreamEncoder:
    """Encodes one utterance of mono PCM16 at ``sample_rate_hz`` Hz into ``fmt``, push by push.

    ``push`` returns the bytes ready now (possibly none: an encoder waits for a whole frame and its
    look-ahead, see the module's table); ``close`` returns the rest with any trailer. The bytes of
    all calls, concatenated, are the file. Nothing is re-encoded: each push encodes only its samples.
    """

    def __init__(self, fmt: AudioFormat, sample_rate_hz: int) -> None:
        self.format = fmt
        self.sample_rate_hz = sample_rate_hz
        self._drain = _Drain()
        self._muxer = None if fmt is AudioFormat.PCM else _Muxer(fmt, sample_rate_hz, self._drain)
        self._closed = False

    def push(self, pcm16: bytes) -> bytes:
        """Encode ``pcm16`` (little-endian 16-bit samples, even length); the bytes ready now."""
        if self._closed:
            raise ValueError("push after close")
        if self._muxer is None:
            check_pcm16(pcm16)
            return pcm16
        if pcm16:
            self._muxer.write(pcm16)
        return self._drain.take()

    def close(self) -> bytes:
        """Flush the encoder; the remaining bytes, with the container's trailer if it has one."""
        if self._closed:
            return b""
        self._closed = True
        if self._muxer is None:
            return b""
        self._muxer.finish()
        return self._drain.take()


def stream_encoder(fmt: AudioFormat | str, sample_rate_hz: int) -> StreamEncoder:
    """A ``StreamEncoder`` for ``fmt`` (a format or its name); ValueError for an unknown format or
    a sample rate (Hz) its codec cannot take (Opus: 8,000/12,000/16,000/24,000/48,000)."""
    return StreamEncoder(AudioFormat.parse(fmt), sample_rate_hz)


def encode_whole(fmt: AudioFormat | str, pcm16: bytes, sample_rate_hz: int) -> bytes:
    """One complete file of ``pcm16`` (mono, ``sample_rate_hz`` Hz) in ``fmt``.

    Written to a seekable buffer, so the muxer fixes up what a stream cannot: WAV's exact sizes,
    FLAC's total sample count and MD5, and an mp3's Xing/LAME frame (encoder delay and padding).
    """
    fmt = AudioFormat.parse(fmt)
    if fmt is AudioFormat.PCM:
        return bytes(pcm16)
    buf = io.BytesIO()
    muxer = _Muxer(fmt, sample_rate_hz, buf)
    if pcm16:
        muxer.write(pcm16)
    muxer.finish()
    return buf.getvalue()
