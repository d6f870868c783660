"""The ``tiny`` codec adapter: the generated ``tiny-code2wav`` decoder (:mod:`libs.models.codec`).

One code per frame; each code decodes on its own, so no context is needed. A batch decodes chunk
by chunk: one pass over concatenated codes would change float32 rounding, hence a chunk's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from libs.models.codec import CodecDecoder, load_codec
from services.stage_worker.codecs.base import CodecAdapter, CodeChunk, to_pcm16


class TinyCodecAdapter(CodecAdapter):
    """``tiny-code2wav`` (or any :class:`~libs.models.codec.CodecDecoder` directory)."""

    name = "tiny"
    context = (0, 0)

    def __init__(self, model: CodecDecoder) -> None:
        self._model = model
        self.sample_rate = model.cfg.sample_rate
        self.samples_per_frame = model.cfg.samples_per_code
        self.codebook_sizes = (model.cfg.num_codes,)
        self.max_batch_chunks = 1

    @classmethod
    def load(cls, directory: Path | str) -> TinyCodecAdapter:
        """The adapter of a directory saved by :func:`libs.models.codec.save_codec`."""
        return cls(load_codec(directory))

    def _decode_valid(self, chunks: Sequence[CodeChunk]) -> list[np.ndarray]:
        return [self._decode_own(c.codes[c.before : c.frames - c.after, 0]) for c in chunks]

    def _decode_own(self, codes: np.ndarray) -> np.ndarray:
        """PCM16 of int64 codes ``[frames]``: ``frames × samples_per_frame`` samples."""
        if not codes.size:
            return np.zeros(0, dtype="<i2")
        with torch.inference_mode():
            return to_pcm16(self._model(torch.from_numpy(codes)).numpy())
