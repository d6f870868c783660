"""The speech API's responses: a request's audio events as the bytes of one file in the asked
format, streamed as they are encoded (``stream_format: audio``), or as OpenAI's speech events
(``stream_format: sse``: ``speech.audio.delta`` with base64 bytes of the file, then
``speech.audio.done`` with ``usage``)."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import AsyncIterator

from libs.common.envelopes import ClientEventType
from libs.common.playback import AudioChunk
from services.gateway.audio import AudioFormat, StreamEncoder, stream_encoder
from services.gateway.audio_tempo import Tempo
from services.gateway.errors import APIError
from services.gateway.responses import Job, abandon, abort_reason, events_until_done, sse
from services.gateway.schemas import SpeechUsage

log = logging.getLogger(__name__)


class SpeechEncoding:
    """A request's PCM16 (mono, as code2wav sends it) → the bytes of its file: the speed change
    (pitch kept; none at 1.0), then the format's encoder, both made at the first audio chunk,
    whose sample rate they take."""

    def __init__(self, fmt: str, speed: float) -> None:
        self.format = AudioFormat.parse(fmt)
        self.speed = speed
        self._tempo: Tempo | None = None
        self._encoder: StreamEncoder | None = None
        self.played_bytes = 0
        """PCM16 bytes of the audio the file holds so far (after the speed change)."""

    @property
    def content_type(self) -> str:
        return self.format.content_type

    def push(self, pcm16: bytes, sample_rate_hz: int) -> bytes:
        """The file's bytes that ``pcm16`` completes (possibly none yet)."""
        if self._encoder is None:
            self._encoder = stream_encoder(self.format, sample_rate_hz)
            self._tempo = Tempo(self.speed, sample_rate_hz) if self.speed != 1.0 else None
        if self._tempo is not None:
            pcm16 = self._tempo.push(pcm16)
        self.played_bytes += len(pcm16)
        return self._encoder.push(pcm16)

    def close(self, sample_rate_hz: int) -> bytes:
        """The file's last bytes (an empty file's whole, when no audio came)."""
        if self._encoder is None:
            self._encoder = stream_encoder(self.format, sample_rate_hz)
        out = b""
        if self._tempo is not None:
            rest = self._tempo.close()
            self.played_bytes += len(rest)
            out = self._encoder.push(rest)
        return out + self._encoder.close()


async def _file_bytes(job: Job, enc: SpeechEncoding) -> AsyncIterator[bytes]:
    """The encoded bytes of the request's audio as they come; raises :class:`APIError` when the
    request fails. The client's playback is recorded (the audio metrics) by what it is sent."""
    sample_rate, frames = 0, 0
    async for ev in events_until_done(job):
        if ev.type == ClientEventType.AUDIO:
            sample_rate, frames = ev.sample_rate or sample_rate, frames + ev.frames
            before = enc.played_bytes
            out = enc.push(ev.pcm16, ev.sample_rate)
            job.stats.audio_chunks.append(AudioChunk(time.monotonic(), enc.played_bytes - before))
            if out:
                yield out
        elif ev.type == ClientEventType.AUDIO_DONE:
            sample_rate = ev.sample_rate or sample_rate
    job.speech_frames = frames
    tail = enc.close(sample_rate)
    if tail:
        yield tail


async def speech_file(job: Job, enc: SpeechEncoding) -> AsyncIterator[bytes]:
    """``stream_format: audio``: the file's bytes. A failure after the first byte cannot be told
    in the body: the connection is cut (the client sees a broken transfer, not a short file that
    looks whole) and the request is stopped in every stage; a client that hangs up stops it too."""
    completed = False
    try:
        try:
            async for chunk in _file_bytes(job, enc):
                yield chunk
            completed = True
        except APIError as e:
            log.warning("speech request %s failed after its response began: %s", job.id, e.message)
            job.client.abort(job.id, abort_reason(e))
            completed = True
            raise
    finally:
        if completed:
            job.client.release(job.id)
        else:
            abandon(job)


async def speech_events(job: Job, enc: SpeechEncoding) -> AsyncIterator[str]:
    """``stream_format: sse``: a ``speech.audio.delta`` event per piece of the file, then
    ``speech.audio.done`` with the usage (``input_tokens``: the input's tokens; ``output_tokens``:
    the codec frames of the audio); a failure is an error event in OpenAI's shape."""
    completed = False
    try:
        try:
            async for chunk in _file_bytes(job, enc):
                yield _event("speech.audio.delta", audio=base64.b64encode(chunk).decode())
            usage = SpeechUsage(
                input_tokens=job.speech_tokens,
                output_tokens=job.speech_frames,
                total_tokens=job.speech_tokens + job.speech_frames,
            )
            yield _event("speech.audio.done", usage=usage.model_dump())
        except APIError as e:
            yield e.sse()
            job.client.abort(job.id, abort_reason(e))
        completed = True
    finally:
        if completed:
            job.client.release(job.id)
        else:
            abandon(job)


def _event(kind: str, **fields: object) -> str:
    return sse(json.dumps({"type": kind, **fields}))
