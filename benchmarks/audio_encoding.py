"""``omnirelay bench audio-encoding``: what the gateway's audio encoding costs, per format.

Each format's ``StreamEncoder`` (``services/gateway/audio.py``) encodes ``--seconds`` of a
speech-like 24 kHz signal pushed in chunks of 12,288 samples (6 SNAC frames, 0.512 s: an Orpheus
talker's chunk), plus ``close``; so does ``Tempo`` at a few speeds. The process is pinned to one
core, as a gateway's encoding runs on its event loop's thread. Per format, over ``--rounds``
(formats interleaved within a round, so each round's readings share the machine's conditions):
the real-time factor (encode seconds / audio seconds; median and worst round), the longest single
push in ms (how long one chunk holds the event loop), and the output's bit rate.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.harness import log
from benchmarks.paired import table
from benchmarks.process_table import machine_activity
from services.gateway.audio import AudioFormat, StreamEncoder, stream_encoder
from services.gateway.audio_tempo import Tempo

RATE = 24_000
CHUNK = 12_288
"""Samples per push: 6 frames × 2,048 samples."""
TEMPO_SPEEDS = (0.5, 1.5, 4.0)


@dataclass(frozen=True)
class Row:
    """One format (or speed): RTF median and worst, longest push (ms), bit rate (kbit/s)."""

    name: str
    rtf_median: float
    rtf_worst: float
    max_push_ms: float
    kbit_s: float


def speech_like(seconds: float, seed: int = 0) -> bytes:
    """``seconds`` of PCM16 at 24 kHz: voiced harmonics under a syllable-rate envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    x = 0.25 * voiced * envelope + 0.02 * rng.standard_normal(len(t))
    return (np.clip(x, -1, 1) * 32_000).astype("<i2").tobytes()


def _run(subject: StreamEncoder | Tempo, pcm: bytes) -> tuple[float, float, int]:
    """Seconds in all, longest push in seconds, bytes out."""
    longest, out = 0.0, 0
    start = time.perf_counter()
    for i in range(0, len(pcm), CHUNK * 2):
        t0 = time.perf_counter()
        out += len(subject.push(pcm[i : i + CHUNK * 2]))
        longest = max(longest, time.perf_counter() - t0)
    out += len(subject.close())
    return time.perf_counter() - start, longest, out


def measure(seconds: float, rounds: int) -> list[Row]:
    """Every format and tempo speed, ``rounds`` times each, interleaved."""
    pcm = speech_like(seconds)
    audio_s = len(pcm) / 2 / RATE
    subjects: dict[str, Callable[[], StreamEncoder | Tempo]] = {}
    for fmt in AudioFormat:
        subjects[fmt.value] = lambda fmt=fmt: stream_encoder(fmt, RATE)
    for speed in TEMPO_SPEEDS:
        subjects[f"tempo {speed}"] = lambda speed=speed: Tempo(speed, RATE)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in subjects}
    for _ in range(rounds):
        for name, make in subjects.items():
            runs[name].append(_run(make(), pcm))
    return [
        Row(
            name,
            statistics.median(r[0] for r in rs) / audio_s,
            max(r[0] for r in rs) / audio_s,
            1e3 * max(r[1] for r in rs),
            8 * rs[0][2] / audio_s / 1e3,
        )
        for name, rs in runs.items()
    ]


def run_audio_encoding(seconds: float, rounds: int, core: int | None = None) -> int:
    """Pin this process to ``core`` (default: the last usable), measure every format, print the
    table."""
    core = core if core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    log(f"machine before (pinned to core {core}): {machine_activity()}")
    rows = measure(seconds, rounds)
    log(f"machine after: {machine_activity()}")
    header = ("format", "RTF median", "RTF worst", "max push ms", "kbit/s")
    cells = [
        (r.name, f"{r.rtf_median:.4f}", f"{r.rtf_worst:.4f}", f"{r.max_push_ms:.2f}", f"{r.kbit_s:.1f}")
        for r in rows
    ]
    print(table(header, cells))
    return 0
