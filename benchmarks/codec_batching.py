"""``omnirelay bench codec-batching``: what cross-request batching gives code2wav's SNAC decode.

code2wav decodes the chunks of several requests that wait together in one forward pass
(``services/stage_worker/codecs/batcher.py``). This bench decodes ``batch`` chunks (one per
request, each ``own`` frames plus the adapter's 3 + 3 frames of context, at different absolute
positions) both ways, the two arms of the paired runner (:mod:`benchmarks.paired`): *without*, one
forward pass per chunk, and *with*, one pass for all of them (``CodecAdapter.decode_batch``),
compared without ÷ with (> 1: batching is faster). Throughput is seconds of audio (own frames ×
2,048 samples / 24 kHz) per second of decode time.

The decoder runs with one intra-op thread, as the code2wav worker does. ``real_size`` also
measures a SNAC with the real ``snac_24khz`` widths (random weights built in memory: no download).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from snac import SNAC

from benchmarks.harness import log
from benchmarks.paired import Figure, render, run_paired, write_json
from benchmarks.process_table import machine_activity
from libs.models.tiny import TINY_SNAC, resolve_model
from libs.models.tiny_snac import SNAC_24KHZ_STRUCTURE
from services.stage_worker.codecs.base import CodeChunk
from services.stage_worker.codecs.snac import SnacCodecAdapter

REAL_WIDTHS = {"encoder_dim": 48, "latent_dim": None, "decoder_dim": 1024, "codebook_size": 4096}
"""``hubertsiuzdak/snac_24khz``'s widths (19.8 M parameters) on top of the 24 kHz structure."""


WITHOUT, WITH = "without", "with"


@dataclass(frozen=True)
class Cell:
    """What one cell decodes: ``chunks`` with ``adapter``, holding ``audio_s`` seconds of audio."""

    adapter: SnacCodecAdapter
    chunks: list[CodeChunk]
    audio_s: float

    def decode(self, arm: str) -> float:
        """Decode the chunks one pass per chunk (:data:`WITHOUT`) or in one pass; seconds."""
        start = time.perf_counter()
        if arm == WITHOUT:
            for chunk in self.chunks:
                self.adapter.decode_batch([chunk])
        else:
            self.adapter.decode_batch(self.chunks)
        return time.perf_counter() - start


@dataclass(frozen=True)
class Decode:
    """One arm's decode of one cell: seconds, and the seconds of audio it made."""

    seconds: float
    audio_s: float


FIGURES: tuple[Figure[Decode], ...] = (
    Figure("decode", "ms", lambda d: d.seconds * 1e3),
    Figure("audio s per s", "", lambda d: d.audio_s / d.seconds, compare=""),
)
"""The decode time, compared without ÷ with (> 1: batching is faster), and the throughput."""


def chunks_for(adapter: SnacCodecAdapter, own: int, batch: int, seed: int) -> list[CodeChunk]:
    """``batch`` chunks of ``own`` frames with full contexts, at different absolute positions."""
    rng = np.random.default_rng(seed)
    before, after = adapter.context
    frames = before + own + after
    sizes = np.asarray(adapter.codebook_sizes)
    return [
        CodeChunk(
            (rng.integers(0, 2**31, (frames, adapter.codes_per_frame)) % sizes).astype(np.int32),
            before + i * own,
            before,
            after,
        )
        for i in range(batch)
    ]


def cell(adapter: SnacCodecAdapter, own: int, batch: int) -> Cell:
    """The cell of ``batch`` chunks of ``own`` frames, both of its shapes decoded once (warm-up)."""
    chunks = chunks_for(adapter, own, batch, seed=own * 1000 + batch)
    c = Cell(adapter, chunks, batch * own * adapter.samples_per_frame / adapter.sample_rate)
    c.decode(WITHOUT)
    c.decode(WITH)
    return c


def run_codec_batching(
    batches: Sequence[int],
    own_frames: Sequence[int],
    rounds: int,
    real_size: bool = False,
    json_path: Path | None = None,
) -> int:
    """Decode every (model, own frames, batch) cell both ways in ``rounds`` paired rounds, print
    the table (and the JSON to ``json_path``)."""
    torch.set_num_threads(1)
    models = {TINY_SNAC: SnacCodecAdapter.load(resolve_model(TINY_SNAC))}
    if real_size:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            models["snac_24khz widths"] = SnacCodecAdapter(SNAC(**SNAC_24KHZ_STRUCTURE, **REAL_WIDTHS))
    log(f"machine before: {machine_activity()}")
    cells = {
        f"{name} own={own} batch={batch}": cell(adapter, own, batch)
        for name, adapter in models.items()
        for own in own_frames
        for batch in batches
    }

    def one(arm: str, c: Cell, _: int) -> Decode:
        return Decode(c.decode(arm), c.audio_s)

    paired = asyncio.run(run_paired((WITHOUT, WITH), cells, rounds, one, baseline=WITH, figures=FIGURES))
    log(f"machine after: {machine_activity()}")
    print(render(paired, FIGURES))
    if json_path:
        options = {"batches": batches, "own_frames": own_frames, "rounds": rounds, "real_size": real_size}
        write_json(json_path, options, paired, FIGURES)
    return 0
