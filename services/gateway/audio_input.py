"""The caller's audio, as the listener takes it: any file FFmpeg reads (wav, mp3, ogg/opus, flac,
m4a, webm, ...) decoded through PyAV and resampled to mono PCM16 at 16 kHz
(:data:`~libs.common.envelopes.INPUT_SAMPLE_RATE`).

A request's audio travels whole in one bus message (the admission, then the listener's task), so
its length is bounded: :data:`MAX_INPUT_AUDIO_S` seconds fit the broker's default message size
(1 MiB) with room to spare.
"""

from __future__ import annotations

import io

import av

from libs.common.envelopes import INPUT_SAMPLE_RATE
from services.gateway.errors import APIError, bad_request

MAX_INPUT_AUDIO_S = 30.0
"""Longest audio one request may carry, seconds (960,000 bytes of 16 kHz PCM16)."""
BYTES_PER_SECOND = INPUT_SAMPLE_RATE * 2


def decode_audio(data: bytes, param: str, max_s: float = MAX_INPUT_AUDIO_S) -> bytes:
    """``data`` (a file's bytes) as mono PCM16 at 16 kHz; a 400 in OpenAI's shape, naming
    ``param``, when it is no audio FFmpeg can read, holds no sound, or is longer than ``max_s``."""
    if not data:
        raise bad_request("the audio file is empty", param, "invalid_audio")
    limit = int(max_s * BYTES_PER_SECOND)
    out = bytearray()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise bad_request("the file holds no audio stream", param, "invalid_audio")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=INPUT_SAMPLE_RATE)
            for frame in container.decode(audio=0):
                for piece in resampler.resample(frame):
                    out += piece.to_ndarray().tobytes()
                if len(out) > limit:
                    raise _too_long(param, max_s)
            for piece in resampler.resample(None):
                out += piece.to_ndarray().tobytes()
    except (av.FFmpegError, ValueError) as e:
        raise bad_request(
            f"the file is not audio this server can decode: {e}", param, "invalid_audio"
        ) from None
    if len(out) > limit:
        raise _too_long(param, max_s)
    if not out:
        raise bad_request("the audio file holds no samples", param, "invalid_audio")
    return bytes(out)


def duration_s(pcm16: bytes) -> float:
    """Seconds of 16 kHz mono PCM16."""
    return len(pcm16) / BYTES_PER_SECOND


def _too_long(param: str, max_s: float) -> APIError:
    return bad_request(f"the audio is longer than this server takes ({max_s:g} s)", param, "audio_too_long")
