"""The ``snac`` codec adapter: SNAC 24 kHz (PyPI ``snac``), the decoder of Orpheus TTS.

Frames. One frame is one layer-0 code (2,048 samples) and holds 1 + 2 + 4 = 7 codes of SNAC's three
layers, in Orpheus's order (:data:`LAYER_OF_POSITION`; within a layer, in time order).

Context. The decoder is not causal: with :data:`CONTEXT_FRAMES` = 3 frames of the neighbouring
chunks on each side, a chunk's own frames decode to the samples of a whole-utterance decode
(tests/unit/test_snac_codec.py shows it, and that 2 frames are not enough).

Noise. Each ``NoiseBlock`` of the decoder adds fresh random noise on every call. At load time each
is swapped for :class:`FrameSeededNoise`, which keeps the block's trained ``linear`` and draws each
frame's noise from a generator seeded by the frame's absolute index (:func:`frame_noise`), so a
frame decodes alike in any chunk, on any replica, and in a whole decode.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock

from services.stage_worker.codecs.base import CodecAdapter, CodeChunk, to_pcm16

LAYER_OF_POSITION = (0, 1, 2, 2, 1, 2, 2)
"""SNAC layer of each of the 7 positions of an Orpheus frame."""
VQ_STRIDES = [4, 2, 1]
"""The layer strides (in hops) the 7-code frame layout is made for: SNAC 24 kHz's."""
CONTEXT_FRAMES = (3, 3)
"""Frames of context (before, after) a chunk needs for its own frames to decode exactly."""
GPU_MAX_BATCH_CHUNKS = 16
"""Chunks per forward pass on a GPU; on a CPU a pass takes one chunk (a batch measured no faster
there, docs/models.md)."""
NOISE_SEED = 0x5EED_0000
"""Frame ``f``'s noise comes from a generator seeded with ``NOISE_SEED + f``."""


def frames_to_layers(codes: np.ndarray) -> list[np.ndarray]:
    """Orpheus frames ``[..., frames, 7]`` → SNAC's three layers ``[..., frames · n]`` with n = 1,
    2, 4 codes per frame (the codes of one layer in time order)."""
    lead = codes.shape[:-2]
    return [
        codes[..., [p for p, lay in enumerate(LAYER_OF_POSITION) if lay == layer]].reshape(*lead, -1)
        for layer in range(len(VQ_STRIDES))
    ]


def frame_noise(frame: int, steps_per_frame: Sequence[int]) -> list[torch.Tensor]:
    """The noise of absolute frame ``frame`` for each noise block: ``steps_per_frame[k]`` standard
    normal samples for block ``k`` (its time steps in one frame), float32."""
    generator = torch.Generator().manual_seed(NOISE_SEED + frame)
    return list(torch.randn(sum(steps_per_frame), generator=generator).split(list(steps_per_frame)))


class FrameNoise:
    """The noise of the forward pass under way, one ``[batch, 1, steps]`` tensor per noise block,
    set by :meth:`prepare` before the pass (under the adapter's lock)."""

    def __init__(self, steps_per_frame: Sequence[int]) -> None:
        self.steps_per_frame = tuple(steps_per_frame)
        self._blocks: list[torch.Tensor] = []

    def prepare(self, starts: Sequence[int], frames: int, device: torch.device) -> None:
        """Noise for a batch whose item ``b`` covers absolute frames ``starts[b]`` to
        ``starts[b] + frames - 1``."""
        per_item = [[frame_noise(s + i, self.steps_per_frame) for i in range(frames)] for s in starts]
        self._blocks = [
            torch.stack([torch.cat([f[k] for f in item]) for item in per_item]).unsqueeze(1).to(device)
            for k in range(len(self.steps_per_frame))
        ]

    def block(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """Block ``k``'s noise for an input ``like`` ``[batch, channels, steps]``."""
        noise = self._blocks[k]
        if noise.shape[0] != like.shape[0] or noise.shape[-1] != like.shape[-1]:
            raise RuntimeError(
                f"noise {list(noise.shape)} prepared for another input than {list(like.shape)}"
            )
        return noise.to(like.dtype)


class FrameSeededNoise(torch.nn.Module):
    """A ``NoiseBlock`` whose noise is :class:`FrameNoise`'s: ``x + noise · linear(x)``, the
    block's own formula with its own trained ``linear``."""

    def __init__(self, block: NoiseBlock, index: int, noise: FrameNoise) -> None:
        super().__init__()
        self.linear = block.linear
        self._index = index
        self._noise = noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._noise.block(self._index, x) * self.linear(x)


def _seed_noise_by_frame(model: SNAC) -> FrameNoise:
    """Swap every ``NoiseBlock`` of ``model``'s decoder for a :class:`FrameSeededNoise` fed by the
    returned :class:`FrameNoise`."""
    rates = list(model.decoder_rates)
    blocks = [m for m in model.decoder.modules() if isinstance(m, DecoderBlock)]
    steps = [model.vq_strides[0] * math.prod(rates[: i + 1]) for i in range(len(blocks))]
    noisy = [(i, j) for i, b in enumerate(blocks) for j, m in enumerate(b.block) if isinstance(m, NoiseBlock)]
    noise = FrameNoise([steps[i] for i, _ in noisy])
    for k, (i, j) in enumerate(noisy):
        blocks[i].block[j] = FrameSeededNoise(blocks[i].block[j], k, noise)
    return noise


class SnacCodecAdapter(CodecAdapter):
    """A SNAC 24 kHz checkpoint directory (``config.json`` + ``pytorch_model.bin``)."""

    name = "snac"
    context = CONTEXT_FRAMES

    def __init__(self, model: SNAC, device: torch.device | None = None) -> None:
        if list(model.vq_strides) != VQ_STRIDES or model.attn_window_size is not None:
            raise ValueError(
                f"the snac adapter decodes SNAC 24 kHz's layout (vq_strides {VQ_STRIDES}, no attention); "
                f"this model has vq_strides {list(model.vq_strides)}, attn_window_size {model.attn_window_size}"
            )
        self._device = device or torch.device("cpu")
        self._model = model.to(self._device).eval()
        self._noise = _seed_noise_by_frame(self._model)
        self._lock = threading.Lock()
        self.sample_rate = int(model.sampling_rate)
        self.samples_per_frame = int(model.vq_strides[0] * math.prod(model.decoder_rates))
        self.codebook_sizes = (int(model.codebook_size),) * len(LAYER_OF_POSITION)
        self.max_batch_chunks = GPU_MAX_BATCH_CHUNKS if self._device.type == "cuda" else 1

    @classmethod
    def load(cls, directory: Path | str) -> SnacCodecAdapter:
        """Load with ``SNAC.from_pretrained`` (a local directory: no network), on the GPU if there
        is one."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cls(SNAC.from_pretrained(str(directory)), device)

    def _decode_valid(self, chunks: Sequence[CodeChunk]) -> list[np.ndarray]:
        """Chunks of equal length decode in one forward pass (a padded one would change the
        samples near the padding: zeros are not the codes a whole decode sees)."""
        out: list[np.ndarray] = [np.zeros(0, dtype="<i2")] * len(chunks)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, chunk in enumerate(chunks):
            if chunk.own_frames:
                by_length[chunk.frames].append(i)
        for frames, members in by_length.items():
            waves = self._forward(np.stack([chunks[i].codes for i in members]), [chunks[i] for i in members])
            for i, wave in zip(members, waves, strict=True):
                c = chunks[i]
                out[i] = to_pcm16(
                    wave[c.before * self.samples_per_frame : (frames - c.after) * self.samples_per_frame]
                )
        return out

    def _forward(self, codes: np.ndarray, chunks: Sequence[CodeChunk]) -> np.ndarray:
        """Float waveforms ``[batch, frames · samples_per_frame]`` of ``codes`` ``[batch, frames, 7]``."""
        layers = [torch.from_numpy(np.ascontiguousarray(x)).to(self._device) for x in frames_to_layers(codes)]
        with self._lock, torch.inference_mode():
            self._noise.prepare([c.first_frame - c.before for c in chunks], codes.shape[1], self._device)
            wave = self._model.decode(layers)
        return wave[:, 0, :].double().cpu().numpy()
