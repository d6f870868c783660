"""Server VAD on real speech: the Silero model finds espeak-ng's sentence where its samples are
(measured here from the WAV file's own samples), whatever the size of the pieces it is fed in,
and a pause shorter than ``silence_duration_ms`` does not end the turn."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest

from services.gateway.audio_input import decode_audio
from services.gateway.voice_activity import (
    SpeechPaused,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    TurnSettings,
)
from tests.speech import padded, silence_wav, spoken

SAID = "Turn the lights off in the kitchen, please."
TOLERANCE_MS = 100
"""How far a boundary may be from where the samples say the speech is: three windows."""


@pytest.fixture(scope="module")
def sentence(tmp_path_factory) -> tuple[bytes, float, float]:
    """The WAV file, and where in it the speech starts and ends (seconds): its first and last
    sample louder than 1 % of full scale."""
    path = spoken(SAID, tmp_path_factory.mktemp("vad") / "s.wav")
    with wave.open(str(path)) as w:
        rate, x = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    loud = np.flatnonzero(np.abs(x) > 327)
    return Path(path).read_bytes(), loud[0] / rate, loud[-1] / rate


@pytest.mark.parametrize("piece_ms", [20, 100, 480])
def test_the_turn_is_where_the_speech_is(sentence, piece_ms: int) -> None:
    wav, start_s, end_s = sentence
    pcm = decode_audio(padded(wav, 1.0, 1.5), "file")
    detector, events = TurnDetector(TurnSettings()), []
    step = piece_ms * 32
    for i in range(0, len(pcm), step):
        events += detector.feed(pcm[i : i + step])
    assert [type(e) for e in events] == [SpeechStarted, SpeechPaused, SpeechStopped], events
    assert events[0].audio_start_ms == pytest.approx((1.0 + start_s) * 1000, abs=TOLERANCE_MS)
    assert events[2].audio_end_ms == pytest.approx((1.0 + end_s) * 1000, abs=TOLERANCE_MS)
    assert events[1].audio_end_ms == events[2].audio_end_ms, "the pause announced the turn's end"
    assert not detector.speaking


def test_silence_is_no_turn_and_a_long_pause_ends_one(sentence) -> None:
    wav, _, _ = sentence
    quiet = TurnDetector(TurnSettings())
    assert quiet.feed(decode_audio(silence_wav(2.0), "file")) == []
    eager = TurnDetector(TurnSettings(silence_duration_ms=100))
    events = eager.feed(decode_audio(padded(wav, 0.5, 1.0), "file"))
    assert len([e for e in events if isinstance(e, SpeechStopped)]) >= 2, (
        "the comma's pause ends a turn at 100 ms"
    )
