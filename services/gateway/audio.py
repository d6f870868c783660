"""Audio containers for the API: PCM16 mono samples into a WAV file."""

from __future__ import annotations

import io
import wave

PCM16_WIDTH = 2
"""Bytes per sample of PCM16."""


def pcm16_to_wav(pcm: bytes, sample_rate: int, channels: int = 1) -> bytes:
    """A RIFF/WAVE file holding little-endian 16-bit ``pcm`` at ``sample_rate`` Hz."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(PCM16_WIDTH)
        w.setframerate(sample_rate or 24000)
        w.writeframes(pcm)
    return buf.getvalue()
