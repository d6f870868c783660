"""How a talker cuts its codes into chunks for downstream: pure functions of what was produced."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CodeChunker:
    """Cuts a request's codec codes into chunks of ``size`` codes: chunk ``k`` holds codes
    ``k·size`` to ``(k+1)·size − 1`` (the last may be short). A talker that took the request over
    starts at code ``start`` and drops the codes before the next chunk boundary (sent already)."""

    size: int
    start: int = 0
    _codes: list[int] = field(default_factory=list)
    _skip: int = 0
    next_seq: int = 0  # the number of the next chunk cut

    def __post_init__(self) -> None:
        self.next_seq = -(-self.start // self.size)
        self._skip = self.next_seq * self.size - self.start

    @property
    def sent_upto(self) -> int:
        """Codes before this position are in chunks already cut."""
        return self.next_seq * self.size

    def feed(self, codes: list[int]) -> list[tuple[int, list[int]]]:
        """Add codes; return the chunks they complete, numbered."""
        dropped = min(self._skip, len(codes))
        self._skip -= dropped
        self._codes.extend(codes[dropped:])
        out = []
        while len(self._codes) >= self.size:
            out.append((self.next_seq, self._codes[: self.size]))
            self._codes = self._codes[self.size :]
            self.next_seq += 1
        return out

    def flush(self) -> tuple[int, list[int]]:
        """The last chunk (whatever is left, possibly nothing), numbered."""
        rest, self._codes = self._codes, []
        self.next_seq += 1
        return self.next_seq - 1, rest


@dataclass(frozen=True)
class FrameChunk:
    """One code chunk cut from a segment: its own frames with their context frames around them."""

    seq: int  # StageTask.seq
    first_frame: int  # absolute index of its first own frame (StageTask.offset)
    frames: np.ndarray  # [before + own + after, frame_size] codes (context frames around its own)
    before: int
    after: int

    @property
    def own_frames(self) -> int:
        return int(self.frames.shape[0]) - self.before - self.after


class FrameChunker:
    """Cuts a request's segments of frames into code chunks of at most ``size`` own frames, with up
    to ``context = (before, after)`` context frames from their own segment; a chunk is cut once
    ``after`` frames past it exist or its segment ends. Numbered from ``next_seq``."""

    def __init__(
        self, size: int, context: tuple[int, int], frame_size: int, next_seq: int = 0, next_frame: int = 0
    ) -> None:
        if size < 1 or min(context) < 0:
            raise ValueError(f"chunk size {size} must be >= 1 and context {context} >= 0")
        self.size, self.frame_size = size, frame_size
        self.before, self.after = context
        self.next_seq = next_seq
        self._buffer_start = next_frame  # absolute index of the first frame kept of the segment
        # the segment's frames in no chunk yet, and up to ``before`` before them (joined lazily)
        self._frames: list[np.ndarray] = []
        self._cut = 0  # frames kept that are already in chunks as own frames

    @property
    def next_frame(self) -> int:
        """Absolute index of the first frame in no chunk yet."""
        return self._buffer_start + self._cut

    def feed(self, frames: np.ndarray) -> list[FrameChunk]:
        """Add ``[n, frame_size]`` frames to the current segment; return the chunks now complete."""
        if len(frames):
            self._frames.append(np.asarray(frames))
        out = []
        while self._length() - self._cut >= self.size + self.after:
            out.append(self._chunk(self.size, self.after))
        return out

    def end_segment(self, last: bool = False) -> list[FrameChunk]:
        """End the current segment: return its remaining chunks. ``last``: the request's last
        segment, which yields at least one chunk (maybe empty) so the final chunk has a number."""
        out = []
        while self._cut < self._length():
            own = min(self.size, self._length() - self._cut)
            out.append(self._chunk(own, min(self.after, self._length() - self._cut - own)))
        if last and not out:
            out.append(self._chunk(0, 0))
        self._buffer_start += self._cut
        self._frames, self._cut = [], 0
        return out

    def _length(self) -> int:
        return sum(len(f) for f in self._frames)

    def _chunk(self, own: int, after: int) -> FrameChunk:
        """The next chunk: ``own`` frames from ``_cut``, with ``after`` frames after them."""
        joined = (
            np.concatenate(self._frames) if self._frames else np.zeros((0, self.frame_size), dtype=np.int32)
        )
        before = min(self.before, self._cut)  # the segment's first frame is kept until one is cut
        chunk = FrameChunk(
            seq=self.next_seq,
            first_frame=self.next_frame,
            frames=joined[self._cut - before : self._cut + own + after].astype(np.int32),
            before=before,
            after=after,
        )
        drop = self._cut + own - self.before  # frames no later chunk needs as context
        self._frames = [joined[max(drop, 0) :]] if len(joined) else []
        self._buffer_start += max(drop, 0)
        self._cut += own - max(drop, 0)
        self.next_seq += 1
        return chunk
