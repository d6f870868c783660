"""Real-time playback simulation of a streamed audio response: did the listener hear gaps?

Playback starts at the first chunk's arrival; a chunk that arrives after the buffer ran dry is an
underrun (silence for the difference), and playback resumes with it. Times are seconds, one clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AudioChunk:
    """One chunk as delivered: when it was written to the client (s, one clock) and its size."""

    t_s: float
    nbytes: int


@dataclass(frozen=True)
class Playback:
    duration_s: float
    """Total audio duration."""
    worst_underrun_s: float
    """Longest silence the listener heard between two chunks (0 = continuous)."""
    late_chunks: int
    """Chunks that arrived after the buffer ran dry."""


def simulate_playback(
    chunks: list[AudioChunk], sample_rate: int, sample_width: int = 2, channels: int = 1
) -> Playback:
    """Play ``chunks`` (in arrival order, interleaved PCM) in real time from the first arrival."""
    dry_at: float | None = None  # when the buffered audio runs out
    worst, late, total = 0.0, 0, 0.0
    for c in chunks:
        d = c.nbytes / (sample_rate * sample_width * channels)
        total += d
        if dry_at is None:
            dry_at = c.t_s + d
        elif c.t_s > dry_at:
            worst = max(worst, c.t_s - dry_at)
            late += 1
            dry_at = c.t_s + d
        else:
            dry_at += d
    return Playback(duration_s=total, worst_underrun_s=worst, late_chunks=late)
