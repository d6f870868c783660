"""OpenAI's speech ``speed``: a time-stretch of PCM16 mono that keeps the pitch, streamed.

FFmpeg's ``atempo`` filter (WSOLA: overlapping windows re-spaced where they match best) through a
PyAV filter graph. One ``atempo`` covers 0.5–100, but above 2 it skips samples instead of blending
them, so the factor is split into equal steps within 0.5–2.0: 0.25 is 0.5 × 0.5, 4.0 is 2.0 × 2.0.
"""

from __future__ import annotations

import math
from fractions import Fraction

import av

from services.gateway.audio import PCM16_WIDTH, check_pcm16, pcm16_frame

MIN_SPEED = 0.25
MAX_SPEED = 4.0
"""OpenAI's range of ``speed`` (1.0: as spoken)."""
_STEP_RANGE = 2.0
"""Each ``atempo`` step is within [1 / _STEP_RANGE, _STEP_RANGE], where it blends every sample."""
_FEED_SAMPLES = 1024
"""The graph is fed frames of at most this many samples (~43 ms at 24 kHz): ``atempo`` emits a
frame once its output buffer, sized from the input frame, is full, so small input frames keep
what a push holds back to about one ``atempo`` window (~42 ms) plus this."""


def atempo_steps(speed: float) -> list[float]:
    """``speed`` as the fewest equal factors each within [0.5, 2.0] (their product is ``speed``)."""
    n = max(1, math.ceil(abs(math.log(speed, _STEP_RANGE)) - 1e-9))
    return [speed ** (1 / n)] * n


def check_speed(speed: float) -> float:
    """``speed`` if it is a number in [0.25, 4.0]; ValueError naming the range otherwise."""
    if isinstance(speed, bool) or not (isinstance(speed, int | float) and MIN_SPEED <= speed <= MAX_SPEED):
        raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
    return float(speed)


class Tempo:
    """Plays mono PCM16 at ``speed`` times its pace without changing its pitch.

    ``push(pcm16)`` returns the stretched samples ready now; ``close()`` the rest. ``speed`` 1.0
    passes every push through as the same object. The output is PCM16 mono at ``sample_rate_hz`` Hz,
    about ``input samples / speed`` samples long in all (the filter's last partial window is cut:
    up to ~1,600 samples fewer at 0.25).
    """

    def __init__(self, speed: float, sample_rate_hz: int = 24_000) -> None:
        self.speed = check_speed(speed)
        self.sample_rate_hz = sample_rate_hz
        self._samples_in = 0
        self._closed = False
        self._graph = None if self.speed == 1.0 else self._build(atempo_steps(self.speed))

    def _build(self, steps: list[float]) -> av.filter.Graph:
        graph = av.filter.Graph()
        node = graph.add_abuffer(
            format="s16",
            sample_rate=self.sample_rate_hz,
            layout="mono",
            time_base=Fraction(1, self.sample_rate_hz),
        )
        for step in steps:
            stretch = graph.add("atempo", repr(step))
            node.link_to(stretch)
            node = stretch
        # Pins the sink to PCM16 mono at the input rate, whatever format atempo negotiates.
        out = graph.add("aformat", f"sample_fmts=s16:sample_rates={self.sample_rate_hz}:channel_layouts=mono")
        node.link_to(out)
        sink = graph.add("abuffersink")
        out.link_to(sink)
        graph.configure()
        return graph

    def push(self, pcm16: bytes) -> bytes:
        """Stretch ``pcm16`` (little-endian 16-bit samples, even length); the samples ready now."""
        if self._closed:
            raise ValueError("push after close")
        if self._graph is None:
            check_pcm16(pcm16)
            return pcm16
        view = memoryview(pcm16)
        step = _FEED_SAMPLES * PCM16_WIDTH
        out = bytearray()
        for start in range(0, len(view), step):
            frame = pcm16_frame(view[start : start + step], self.sample_rate_hz, self._samples_in)
            self._samples_in += frame.samples
            self._graph.push(frame)
            out += _pull(self._graph)
        return bytes(out)

    def close(self) -> bytes:
        """Flush the filter; the remaining stretched samples (PCM16)."""
        if self._closed:
            return b""
        self._closed = True
        if self._graph is None:
            return b""
        self._graph.push(None)
        return _pull(self._graph)


def _pull(graph: av.filter.Graph) -> bytes:
    """Every frame the graph's sink has ready, as PCM16 bytes."""
    out = bytearray()
    while True:
        try:
            frame = graph.pull()
        except (av.BlockingIOError, av.EOFError):
            return bytes(out)
        out += frame.to_ndarray().astype("<i2", copy=False).tobytes()
