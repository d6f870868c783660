"""What code2wav needs of a codec: codes of whole frames in, PCM16 mono of the chunk's own frames out.

A chunk's first ``before`` and last ``after`` frames are context: frames of the neighbouring chunks
that a non-causal decoder needs for the own frames to decode as in a whole-utterance decode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PCM_SCALE = 32767.0
"""Full scale of a PCM16 sample: a float sample ``x`` in [-1, 1] becomes ``round(x · 32767)``."""


@dataclass(frozen=True)
class CodeChunk:
    """One chunk to decode. Frames are counted from the start of the request's code stream."""

    codes: np.ndarray
    """``[frames]`` or ``[frames, codes_per_frame]`` integer codes, contexts included."""
    first_frame: int
    """Absolute index of the first own frame (``StageTask.offset``); ``codes[0]`` is frame
    ``first_frame - before``."""
    before: int = 0
    """Context frames at the start of ``codes``."""
    after: int = 0
    """Context frames at the end of ``codes``."""

    @property
    def frames(self) -> int:
        """Frames in ``codes``, contexts included."""
        return int(self.codes.shape[0])

    @property
    def own_frames(self) -> int:
        """Frames whose samples the decode returns."""
        return self.frames - self.before - self.after


def to_pcm16(wave: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] (clipped beyond) → little-endian int16, rounded to nearest."""
    return np.round(np.clip(wave, -1.0, 1.0) * PCM_SCALE).astype("<i2")


class CodecAdapter(ABC):
    """A codec family's decoder as code2wav uses it. Subclasses set the attributes in ``__init__``."""

    name: str
    """The family (``tiny``, ``snac``), as logs and docs name it."""
    sample_rate: int
    """Output sample rate, Hz."""
    samples_per_frame: int
    """PCM samples one frame decodes to."""
    codebook_sizes: tuple[int, ...]
    """Codebook size of each position of a frame (``len`` = codes per frame)."""
    context: tuple[int, int]
    """Frames of context (before, after) a chunk needs (``StageTask.context_before``/``_after``); a
    class attribute: known without loading weights."""
    max_batch_chunks: int
    """Chunks code2wav's batcher puts in one forward pass at most."""

    @classmethod
    @abstractmethod
    def load(cls, directory: Path | str) -> CodecAdapter:
        """The adapter of the checkpoint in ``directory``."""

    @property
    def codes_per_frame(self) -> int:
        """Codes in one frame."""
        return len(self.codebook_sizes)

    def decode(self, codes: np.ndarray, first_frame: int, before: int = 0, after: int = 0) -> np.ndarray:
        """PCM16 (little-endian int16) of the own frames of one chunk: ``own frames ×
        samples_per_frame`` samples. Raises ValueError on a malformed chunk or an out-of-range code."""
        return self.decode_batch([CodeChunk(np.asarray(codes), first_frame, before, after)])[0]

    def decode_batch(self, chunks: Sequence[CodeChunk]) -> list[np.ndarray]:
        """:meth:`decode` of several chunks (of any requests) in as few forward passes as the codec
        allows; the results in the order of ``chunks``. Every chunk is validated before any is
        decoded: one bad chunk raises ValueError for the call (callers decode a chunk alone to
        learn which one)."""
        return self._decode_valid([self._checked(c) for c in chunks])

    def _checked(self, chunk: CodeChunk) -> CodeChunk:
        """The chunk with ``codes`` as int64 ``[frames, codes_per_frame]``, or ValueError naming
        what is wrong (the absolute frame and the position of an out-of-range code)."""
        codes = np.asarray(chunk.codes)
        if codes.ndim == 1 and self.codes_per_frame == 1:
            codes = codes.reshape(-1, 1)
        if codes.ndim != 2 or codes.shape[1] != self.codes_per_frame:
            raise ValueError(
                f"{self.name} codes must be [frames, {self.codes_per_frame}], got shape {list(codes.shape)}"
            )
        if codes.size and not np.issubdtype(codes.dtype, np.integer):
            raise ValueError(f"codes must be integers, got {codes.dtype}")
        if chunk.before < 0 or chunk.after < 0 or chunk.before + chunk.after > codes.shape[0]:
            raise ValueError(
                f"contexts before={chunk.before} after={chunk.after} do not fit {codes.shape[0]} frames"
            )
        if chunk.first_frame - chunk.before < 0:
            raise ValueError(
                f"context before={chunk.before} reaches before frame 0 (first {chunk.first_frame})"
            )
        codes = np.array(codes, dtype=np.int64)  # a writable copy: bus arrays are read-only views
        bad = (codes < 0) | (codes >= np.asarray(self.codebook_sizes))
        if bad.any():
            row, pos = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"code {codes[row, pos]} at frame {chunk.first_frame - chunk.before + row} position {pos} "
                f"is outside its codebook 0..{self.codebook_sizes[pos] - 1}"
            )
        return CodeChunk(codes, chunk.first_frame, chunk.before, chunk.after)

    @abstractmethod
    def _decode_valid(self, chunks: Sequence[CodeChunk]) -> list[np.ndarray]:
        """:meth:`decode_batch` of validated chunks (``codes`` int64 ``[frames, codes_per_frame]``)."""
