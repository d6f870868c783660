"""The underrun simulation on hand-computed chunk schedules."""

from __future__ import annotations

import pytest

from libs.common.playback import AudioChunk, simulate_playback

SR = 1000  # 1000 samples/s, PCM16 mono: 2000 bytes = 1 s, 200 bytes = 0.1 s


def test_on_time_chunks_never_underrun() -> None:
    # 0.1 s chunks arriving every 0.1 s (and one early): the buffer never runs dry.
    chunks = [AudioChunk(0.0, 200), AudioChunk(0.1, 200), AudioChunk(0.15, 200), AudioChunk(0.3, 200)]
    p = simulate_playback(chunks, SR)
    assert p.worst_underrun_s == 0 and p.late_chunks == 0
    assert p.duration_s == pytest.approx(0.4)


def test_late_chunks_underrun_by_the_gap() -> None:
    # plays 0.0-0.1; next arrives 0.25 -> gap 0.15; plays 0.25-0.35; next arrives 0.40 -> gap 0.05
    chunks = [AudioChunk(0.0, 200), AudioChunk(0.25, 200), AudioChunk(0.40, 200)]
    p = simulate_playback(chunks, SR)
    assert p.worst_underrun_s == pytest.approx(0.15) and p.late_chunks == 2


def test_bursty_delivery_buffers_ahead_then_drains() -> None:
    # burst of three 0.1 s chunks at t=0 buffers 0.3 s; the next at 0.29 is on time, the one at
    # 0.6 comes 0.2 s after the buffer (0.4 s) ran dry.
    chunks = [
        AudioChunk(0.0, 200),
        AudioChunk(0.0, 200),
        AudioChunk(0.0, 200),
        AudioChunk(0.29, 200),
        AudioChunk(0.6, 200),
    ]
    p = simulate_playback(chunks, SR)
    assert p.worst_underrun_s == pytest.approx(0.2) and p.late_chunks == 1
    assert p.duration_s == pytest.approx(0.5)


def test_stereo_and_width_scale_durations() -> None:
    p = simulate_playback([AudioChunk(0.0, 4000), AudioChunk(1.5, 4000)], SR, sample_width=2, channels=2)
    assert p.duration_s == pytest.approx(2.0) and p.worst_underrun_s == pytest.approx(0.5)


def test_no_chunks() -> None:
    p = simulate_playback([], SR)
    assert (p.duration_s, p.worst_underrun_s, p.late_chunks) == (0, 0, 0)
