"""FrameChunker (services/stage_worker/chunking.py) against a reference written from its contract:
the chunks of a whole segment computed at once (own frames ``[k·size, min((k+1)·size, n))`` of a
segment of ``n`` frames, context clipped at the segment's ends), released as soon as ``after``
frames past them exist, numbered contiguously across segments, frames counted across segments."""

from __future__ import annotations

import numpy as np
import pytest

from services.stage_worker.chunking import FrameChunk, FrameChunker

FRAME = 7


def segment(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, FRAME), dtype=np.int32)


def reference(
    segments: list[np.ndarray], size: int, before: int, after: int
) -> list[tuple[int, int, np.ndarray, int, int]]:
    """(seq, first_frame, frames, before, after) of every chunk, computed from whole segments, and
    the request's final chunk: an empty one after the last segment when that has no frames, or when
    its last chunk went out before it ended (full, and no context after it needed)."""
    out, seq, frame0 = [], 0, 0
    for seg in segments:
        n = len(seg)
        for start in range(0, n, size):
            end = min(start + size, n)
            b, a = min(before, start), min(after, n - end)
            out.append((seq, frame0 + start, seg[start - b : end + a], b, a))
            seq += 1
        frame0 += n
    last = len(segments[-1])
    if last == 0 or (after == 0 and last % size == 0):
        out.append((seq, frame0, np.zeros((0, FRAME), dtype=np.int32), 0, 0))
    return out


def as_tuple(c: FrameChunk) -> tuple[int, int, np.ndarray, int, int]:
    return c.seq, c.first_frame, c.frames, c.before, c.after


def assert_same(got: list[FrameChunk], want: list[tuple[int, int, np.ndarray, int, int]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        seq, first, frames, b, a = as_tuple(g)
        assert (seq, first, b, a) == (w[0], w[1], w[3], w[4])
        assert frames.dtype == np.int32 and frames.shape == w[2].shape
        np.testing.assert_array_equal(frames, w[2])


@pytest.mark.parametrize("size,context", [(4, (3, 3)), (1, (3, 3)), (5, (0, 0)), (3, (1, 2)), (10, (3, 3))])
@pytest.mark.parametrize("pieces_seed", [0, 1, 2])
def test_chunks_equal_the_whole_segment_reference_whatever_the_feeding(size, context, pieces_seed):
    lengths = [13, 0, 2, 7, 30]
    segments = [segment(n, i) for i, n in enumerate(lengths)]
    rng = np.random.default_rng(pieces_seed)
    chunker = FrameChunker(size, context, FRAME)
    got: list[FrameChunk] = []
    for s, seg in enumerate(segments):
        fed = 0
        while fed < len(seg):
            k = int(rng.integers(1, 6))
            got.extend(chunker.feed(seg[fed : fed + k]))
            fed = min(fed + k, len(seg))
        got.extend(chunker.end_segment(last=s == len(segments) - 1))
    assert_same(got, reference(segments, size, *context))
    assert chunker.next_seq == len(got) and chunker.next_frame == sum(lengths)


def test_a_chunk_goes_out_as_soon_as_after_frames_past_it_exist():
    size, before, after = 4, 3, 3
    seg = segment(20, 5)
    chunker = FrameChunker(size, (before, after), FRAME)
    released: list[int] = []
    for fed in range(1, len(seg) + 1):
        released += [c.seq for c in chunker.feed(seg[fed - 1 : fed])]
        # chunk k is complete once frames up to (k+1)·size + after exist
        assert released == [k for k in range(fed // size) if (k + 1) * size + after <= fed]
    assert released == [0, 1, 2, 3]  # chunk 3 (frames 12-15) went out once frame 18 existed
    tail = chunker.end_segment()
    assert [(c.seq, c.first_frame, c.own_frames, c.after) for c in tail] == [(4, 16, 4, 0)]


def test_the_last_segment_without_frames_left_still_gives_a_numbered_final_chunk():
    chunker = FrameChunker(4, (3, 3), FRAME)
    first = chunker.feed(segment(8, 0)) + chunker.end_segment()
    assert [c.seq for c in first] == [0, 1]
    (final,) = chunker.end_segment(last=True)
    assert (final.seq, final.first_frame, final.frames.shape, final.before, final.after) == (
        2,
        8,
        (0, FRAME),
        0,
        0,
    )
    assert chunker.end_segment() == []  # not the last: an empty segment makes no chunk


def test_a_successor_starting_at_a_position_note_cuts_the_same_later_chunks():
    segments = [segment(n, i) for i, n in enumerate([9, 6, 11])]
    whole = FrameChunker(4, (3, 3), FRAME)
    chunks = []
    for i, seg in enumerate(segments):
        chunks.append(whole.feed(seg) + whole.end_segment(last=i == 2))
    # the note for segment 1: the first code chunk after segment 0's, the first frame after its frames
    note = (len(chunks[0]), len(segments[0]))
    successor = FrameChunker(4, (3, 3), FRAME, next_seq=note[0], next_frame=note[1])
    redo = []
    for i, seg in enumerate(segments[1:], start=1):
        redo += successor.feed(seg) + successor.end_segment(last=i == 2)
    assert_same(redo, [as_tuple(c) for c in chunks[1] + chunks[2]])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        FrameChunker(0, (3, 3), FRAME)
    with pytest.raises(ValueError):
        FrameChunker(4, (-1, 3), FRAME)
