"""``python -m benchmarks.codec_batching``: what cross-request batching gives code2wav's SNAC decode.

code2wav decodes the chunks of several requests that wait together in one forward pass
(``services/stage_worker/codecs/batcher.py``). This bench decodes ``batch`` chunks (one per
request, each ``own`` frames plus the adapter's 3 + 3 frames of context, at different absolute
positions) both ways: *without*, one forward pass per chunk, and *with*, one pass for all of them
(``CodecAdapter.decode_batch``). Every round runs both, alternating which goes first, so the two
readings of a round share the machine's conditions; the statistic is the median over rounds of
the per-round ratio without / with (> 1: batching is faster), with its smallest and largest.
Throughput is seconds of audio (own frames × 2,048 samples / 24 kHz) per second of decode time.

The decoder runs with one intra-op thread, as the code2wav worker does. ``--real-size`` also
measures a SNAC with the real ``snac_24khz`` widths (random weights built in memory: no download).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from snac import SNAC

from benchmarks.harness import log
from benchmarks.process_table import machine_activity
from libs.models.tiny import TINY_SNAC, resolve_model
from libs.models.tiny_snac import SNAC_24KHZ_STRUCTURE
from services.stage_worker.codecs.base import CodeChunk
from services.stage_worker.codecs.snac import SnacCodecAdapter

REAL_WIDTHS = {"encoder_dim": 48, "latent_dim": None, "decoder_dim": 1024, "codebook_size": 4096}
"""``hubertsiuzdak/snac_24khz``'s widths (19.8 M parameters) on top of the 24 kHz structure."""


@dataclass(frozen=True)
class Row:
    """One (model, chunk size, batch size) cell: medians over rounds; times in seconds."""

    model: str
    own_frames: int
    batch: int
    without_s: float
    with_s: float
    ratio_median: float
    ratio_min: float
    ratio_max: float
    audio_s: float
    """Seconds of audio the batch's own frames hold."""


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


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure(adapter: SnacCodecAdapter, model: str, own: int, batch: int, rounds: int) -> Row:
    """Alternated paired rounds of one-pass-per-chunk against one pass for the batch."""
    chunks = chunks_for(adapter, own, batch, seed=own * 1000 + batch)

    def without() -> None:
        for chunk in chunks:
            adapter.decode_batch([chunk])

    def together() -> None:
        adapter.decode_batch(chunks)

    without()  # warm-up of both shapes
    together()
    pairs: list[tuple[float, float]] = []
    for r in range(rounds):
        if r % 2:
            t_with, t_without = _timed(together), _timed(without)
        else:
            t_without, t_with = _timed(without), _timed(together)
        pairs.append((t_without, t_with))
    ratios = [a / b for a, b in pairs]
    return Row(
        model=model,
        own_frames=own,
        batch=batch,
        without_s=statistics.median(a for a, _ in pairs),
        with_s=statistics.median(b for _, b in pairs),
        ratio_median=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        audio_s=batch * own * adapter.samples_per_frame / adapter.sample_rate,
    )


def table(rows: Sequence[Row]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| model | own frames (+3+3) | batch | without, ms | with, ms | speedup median [min, max] "
        "| audio s per s, without → with |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.own_frames} | {r.batch} | {r.without_s * 1e3:.1f} | {r.with_s * 1e3:.1f} "
            f"| {r.ratio_median:.2f} [{r.ratio_min:.2f}, {r.ratio_max:.2f}] "
            f"| {r.audio_s / r.without_s:.1f} → {r.audio_s / r.with_s:.1f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].strip("`"))
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16], help="chunks per pass, comma-separated")
    parser.add_argument(
        "--own-frames", type=_ints, default=[2, 8], help="own frames per chunk, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds per cell")
    parser.add_argument("--real-size", action="store_true", help="also a SNAC with snac_24khz's widths")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    models = {TINY_SNAC: SnacCodecAdapter.load(resolve_model(TINY_SNAC))}
    if args.real_size:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            models["snac_24khz widths"] = SnacCodecAdapter(SNAC(**SNAC_24KHZ_STRUCTURE, **REAL_WIDTHS))
    log(f"machine before: {machine_activity()}")
    rows = []
    for name, adapter in models.items():
        for own in args.own_frames:
            for batch in args.batches:
                rows.append(measure(adapter, name, own, batch, args.rounds))
                log(f"{name} own={own} batch={batch}: speedup {rows[-1].ratio_median:.2f}")
    log(f"machine after: {machine_activity()}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
