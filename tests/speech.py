"""Real speech for the listener's tests: Debian's ``espeak-ng`` speaking a sentence into a WAV
file, with silence around it when asked; and how close a transcript is to the words spoken."""

from __future__ import annotations

import io
import re
import subprocess
import wave
from pathlib import Path

import numpy as np

from tests.needs import program

VOICE, WORDS_PER_MINUTE = "en-us", 150
"""espeak-ng's American English at a calm rate, which Whisper tiny.en hears best."""


def spoken(text: str, path: Path) -> Path:
    """``path``: a WAV file of espeak-ng saying ``text`` (22,050 Hz mono PCM16)."""
    espeak = program("espeak-ng", "espeak-ng speaks the listener tests' sentences (apt install espeak-ng)")
    subprocess.run([espeak, "-v", VOICE, "-s", str(WORDS_PER_MINUTE), "-w", str(path), text], check=True)
    return path


def wav_seconds(data: bytes) -> float:
    """The duration of a WAV file's samples, read with the standard library's ``wave``."""
    with wave.open(io.BytesIO(data)) as w:
        return w.getnframes() / w.getframerate()


def padded(data: bytes, before_s: float, after_s: float) -> bytes:
    """A WAV file's samples with ``before_s`` and ``after_s`` seconds of silence around them."""
    with wave.open(io.BytesIO(data)) as w:
        rate, width, samples = w.getframerate(), w.getsampwidth(), w.readframes(w.getnframes())
    silence = lambda s: bytes(int(s * rate) * width)  # noqa: E731
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(silence(before_s) + samples + silence(after_s))
    return out.getvalue()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def recall(heard: str, said: str) -> float:
    """The share of the words ``said`` that ``heard`` holds (each counted as often as said)."""
    want, got = words(said), words(heard)
    hits = 0
    for w in want:
        if w in got:
            got.remove(w)
            hits += 1
    return hits / len(want)


def silence_wav(seconds: float, rate: int = 16_000) -> bytes:
    """A WAV file of ``seconds`` of silence."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(int(seconds * rate), dtype="<i2").tobytes())
    return out.getvalue()
