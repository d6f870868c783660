"""A realtime session's input audio buffer: the caller's audio since the last commit, as 16 kHz
mono PCM16 (what the listener and the VAD take), on the session's audio clock.

The session's audio clock counts the milliseconds of input audio appended since the session began
(OpenAI's ``audio_start_ms`` / ``audio_end_ms``). With server VAD the buffer keeps, while nobody
speaks, only the last ``prefix_padding_ms`` (what a turn starts with); a turn is cut from the buffer
when the VAD marks its end. When each appended piece arrived (``time.monotonic()``) is kept, so a
turn's end on the audio clock maps to the moment its audio reached the gateway: where
voice-to-voice latency starts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from libs.common.envelopes import INPUT_SAMPLE_RATE
from services.gateway.realtime.audio_formats import InputDecoder
from services.gateway.realtime.protocol import BadEvent, ServerVad
from services.gateway.voice_activity import (
    SpeechPaused,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    TurnSettings,
)

BYTES_PER_MS = INPUT_SAMPLE_RATE * 2 // 1000
MAX_BUFFER_MS = 30_000
"""Longest audio one turn may hold (the listener's bound, services/gateway/audio_input.py)."""


@dataclass(frozen=True)
class Turn:
    """Committed audio: 16 kHz PCM16 from ``start_ms`` to ``end_ms`` on the session's audio clock,
    and when the audio at ``end_ms`` arrived (``time.monotonic()``)."""

    pcm16: bytes
    start_ms: int
    end_ms: int
    arrived_s: float


class InputBuffer:
    """The input audio buffer of one session (see the module's docstring)."""

    def __init__(self, fmt: str, vad: ServerVad | None) -> None:
        self._decoder = InputDecoder(fmt)
        self._pcm = bytearray()
        self._start_ms = 0
        """The audio clock at the buffer's first byte."""
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=4096)
        """(audio clock at the end of an appended piece, when it arrived)."""
        self.vad = vad
        self._detector = TurnDetector(_settings(vad)) if vad is not None else None
        self.speech_start_ms: int | None = None

    @property
    def end_ms(self) -> int:
        """The session's audio clock: ms of input audio appended so far."""
        return self._start_ms + len(self._pcm) // BYTES_PER_MS

    @property
    def empty(self) -> bool:
        return len(self._pcm) < BYTES_PER_MS

    def append(self, data: bytes) -> list[SpeechStarted | SpeechPaused | SpeechStopped]:
        """Take ``data`` (audio in the session's input format); the VAD's turn boundaries it reveals."""
        pcm = self._decoder.push(data)
        self._pcm += pcm
        self._arrivals.append((self.end_ms, time.monotonic()))
        if self._detector is None:
            if self.end_ms - self._start_ms > MAX_BUFFER_MS:
                del self._pcm[len(self._pcm) - len(pcm) :]
                raise BadEvent(
                    f"the input audio buffer holds at most {MAX_BUFFER_MS // 1000} s: commit or clear it",
                    "input_audio_buffer_full",
                    "audio",
                )
            return []
        events = self._detector.feed(pcm)
        for e in events:
            if isinstance(e, SpeechStarted):
                self.speech_start_ms = e.audio_start_ms
        if self.speech_start_ms is None:
            self._keep_last(self.vad.prefix_padding_ms if self.vad else 0)
        elif self.end_ms - self.speech_start_ms > MAX_BUFFER_MS:  # a turn that never pauses is cut
            events.append(SpeechStopped(self.end_ms))
        return events

    def peek(self, end_ms: int | None = None) -> Turn:
        """The turn that ends at ``end_ms`` (the whole buffer when None), left in the buffer: from
        ``prefix_padding_ms`` before its speech started, or the buffer's start."""
        end = self.end_ms if end_ms is None else min(end_ms, self.end_ms)
        start = self._start_ms
        if self.speech_start_ms is not None and self.vad is not None:
            start = max(start, self.speech_start_ms - self.vad.prefix_padding_ms)
        a, b = (start - self._start_ms) * BYTES_PER_MS, (end - self._start_ms) * BYTES_PER_MS
        return Turn(bytes(self._pcm[a:b]), start, end, self._arrival(end))

    def commit(self, end_ms: int | None = None) -> Turn:
        """:meth:`peek`, and the turn cut out of the buffer."""
        turn = self.peek(end_ms)
        del self._pcm[: (turn.end_ms - self._start_ms) * BYTES_PER_MS]
        self._start_ms, self.speech_start_ms = turn.end_ms, None
        return turn

    def clear(self) -> None:
        self._start_ms = self.end_ms
        self._pcm.clear()
        self.speech_start_ms = None

    def _keep_last(self, ms: int) -> None:
        drop = max(0, len(self._pcm) - ms * BYTES_PER_MS)
        drop -= drop % BYTES_PER_MS
        if drop:
            del self._pcm[:drop]
            self._start_ms += drop // BYTES_PER_MS

    def _arrival(self, at_ms: int) -> float:
        """When the audio at ``at_ms`` on the audio clock arrived."""
        for end, t in self._arrivals:
            if end >= at_ms:
                return t
        return time.monotonic()


def _settings(vad: ServerVad) -> TurnSettings:
    return TurnSettings(vad.threshold, vad.prefix_padding_ms, vad.silence_duration_ms)
