"""Server VAD: where the caller's speech starts and stops, judged by the Silero VAD model that
faster-whisper ships (ONNX, run with onnxruntime), never by an energy threshold.

The model takes 16 kHz audio in windows of 512 samples (32 ms) with the 64 samples before each as
context, and carries a recurrent state from one window to the next: :class:`SpeechProbability`
keeps that state for one audio stream. :class:`TurnDetector` turns the probabilities into OpenAI's
``server_vad`` turn boundaries: speech starts at the first window whose probability reaches
``threshold``; it stops once ``silence_duration_ms`` of windows below it have followed, at the end
of the last speech window. Half-way through that silence it reports a pause at the same end, so the
turn's transcription can begin while the silence is still being waited for. Times are milliseconds of the stream's audio from its first sample.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from libs.common.envelopes import INPUT_SAMPLE_RATE

WINDOW = 512
"""Samples per window at 16 kHz (32 ms): the model's unit."""
CONTEXT = 64
"""Samples before a window that the model reads with it."""
WINDOW_MS = WINDOW * 1000 // INPUT_SAMPLE_RATE


@functools.cache
def _session():
    import onnxruntime
    from faster_whisper.utils import get_assets_path

    opts = onnxruntime.SessionOptions()
    opts.inter_op_num_threads = opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    path = os.path.join(get_assets_path(), "silero_vad_v6.onnx")
    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"], sess_options=opts)


class SpeechProbability:
    """The model's speech probability of each 32 ms window of one audio stream, in order."""

    def __init__(self) -> None:
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)

    def feed(self, pcm16: bytes) -> list[float]:
        """The probabilities of the windows ``pcm16`` (16 kHz mono PCM16) completes."""
        audio = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
        self._pending = np.concatenate([self._pending, audio])
        out = []
        while len(self._pending) >= WINDOW:
            window, self._pending = self._pending[:WINDOW], self._pending[WINDOW:]
            x = np.concatenate([self._context, window])[None, :]
            prob, self._h, self._c = _session().run(None, {"input": x, "h": self._h, "c": self._c})
            self._context = window[-CONTEXT:]
            out.append(float(np.asarray(prob).reshape(-1)[0]))
        return out


@dataclass(frozen=True)
class TurnSettings:
    """OpenAI's ``server_vad`` settings that decide where a turn is."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


@dataclass(frozen=True)
class SpeechPaused:
    """Half of ``silence_duration_ms`` of silence has followed speech that ended at
    ``audio_end_ms``: the turn may end there (if the silence lasts), so its transcription can begin."""

    audio_end_ms: int


class TurnDetector:
    """Speech starts and stops in one audio stream (see the module's docstring)."""

    def __init__(self, settings: TurnSettings) -> None:
        self.settings = settings
        self._probability = SpeechProbability()
        self._windows = 0
        """Windows judged so far."""
        self._speaking = False
        self._last_speech = 0
        """The window after the last speech window (its end, in windows)."""

    def feed(self, pcm16: bytes) -> list[SpeechStarted | SpeechPaused | SpeechStopped]:
        """The boundaries the audio ``pcm16`` (16 kHz mono PCM16, following what came before) reveals."""
        events: list[SpeechStarted | SpeechPaused | SpeechStopped] = []
        silence_windows = -(-self.settings.silence_duration_ms // WINDOW_MS)
        pause_windows = max(1, silence_windows // 2)
        for p in self._probability.feed(pcm16):
            self._windows += 1
            if p >= self.settings.threshold:
                if not self._speaking:
                    self._speaking = True
                    events.append(SpeechStarted((self._windows - 1) * WINDOW_MS))
                self._last_speech = self._windows
            elif self._speaking and self._windows - self._last_speech >= silence_windows:
                self._speaking = False
                events.append(SpeechStopped(self._last_speech * WINDOW_MS))
            elif self._speaking and self._windows - self._last_speech == pause_windows:
                events.append(SpeechPaused(self._last_speech * WINDOW_MS))
        return events

    @property
    def speaking(self) -> bool:
        return self._speaking
