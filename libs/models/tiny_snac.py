"""``tiny-snac``: the ``snac`` package's :class:`snac.SNAC` with the 24 kHz structure, small widths.

The real ``hubertsiuzdak/snac_24khz`` (what Orpheus TTS decodes with) is built from this
``config.json``: ``sampling_rate`` 24000, ``encoder_dim`` 48, ``encoder_rates`` [2, 4, 8, 8],
``decoder_dim`` 1024, ``decoder_rates`` [8, 8, 4, 2], ``attn_window_size`` null, ``codebook_size``
4096, ``codebook_dim`` 8, ``vq_strides`` [4, 2, 1], ``noise`` and ``depthwise`` true. The tiny one
keeps every field that fixes timing and layout (sample rate, rates, strides, no attention, noise,
depthwise convolutions, codebook dimension) and shrinks only the widths (``encoder_dim``,
``decoder_dim``) and the codebooks (:data:`CODEBOOK_SIZE` entries instead of 4,096).

Units: one hop is ``prod(encoder_rates)`` = 512 samples (46.875 Hz at 24 kHz); a frame is one code
of the coarsest layer, ``vq_strides[0]`` = 4 hops = :data:`SAMPLES_PER_FRAME` = 2,048 samples
(11.72 Hz), holding 1 + 2 + 4 = 7 codes (layers 0, 1, 2).

The directory holds ``config.json`` (``SNAC.__init__``'s keyword arguments, the real file's layout)
and ``pytorch_model.bin`` (a ``torch.save`` d state dict), so ``SNAC.from_pretrained(<dir>)`` loads
it exactly as it loads a local copy of the real checkpoint (a local directory never reaches the
network: the package calls ``hf_hub_download`` only for a name that is not a directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from snac import SNAC

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "pytorch_model.bin"
CODEBOOK_SIZE = 256
"""Entries per codebook of ``tiny-snac`` (the real 24 kHz model has 4,096); the tiny Orpheus talker
sizes its ``<custom_token_N>`` range with it."""
SAMPLES_PER_FRAME = 2048
"""Samples per frame (one coarse code) of the 24 kHz structure: ``vq_strides[0] * prod(rates)``."""
SEED = 4004

SNAC_24KHZ_STRUCTURE: dict[str, object] = {
    "sampling_rate": 24000,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
"""The fields of ``hubertsiuzdak/snac_24khz``'s config that fix timing and layout."""

TINY_SNAC_CONFIG: dict[str, object] = {
    **SNAC_24KHZ_STRUCTURE,
    "encoder_dim": 8,
    "latent_dim": None,
    "decoder_dim": 128,
    "codebook_size": CODEBOOK_SIZE,
}
"""``tiny-snac``'s ``config.json``: latent width 8 · 2⁴ = 128 (real: 768), decoder widths 128 → 8
(real: 1024 → 64)."""


def build_tiny_snac(directory: Path) -> None:
    """Create the seeded ``tiny-snac`` and save ``config.json`` + ``pytorch_model.bin`` into
    ``directory`` (which must exist); the same seed gives the same bytes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = SNAC(**TINY_SNAC_CONFIG)
    text = json.dumps(TINY_SNAC_CONFIG, indent=2, sort_keys=True) + "\n"
    (directory / CONFIG_FILE).write_text(text, encoding="utf-8")
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    torch.save(state, directory / WEIGHTS_FILE)
