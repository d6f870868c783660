"""Codec adapters: how code2wav turns a chunk of codec codes into PCM16 mono.

:class:`~services.stage_worker.codecs.base.CodecAdapter` is the interface (sample rate, samples
per frame, codebook size per position, context frames, single and batched decode);
:func:`load_codec_adapter` picks the family from the model directory, so the pipeline file needs no
field for it:

- ``snac`` (:mod:`~services.stage_worker.codecs.snac`): a SNAC checkpoint, ``config.json`` with
  ``vq_strides`` beside ``pytorch_model.bin`` (``hubertsiuzdak/snac_24khz``, ``tiny-snac``);
- ``tiny`` (:mod:`~services.stage_worker.codecs.tiny`): ``tiny-code2wav``'s ``config.json`` with
  ``samples_per_code`` beside ``model.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.stage_worker.codecs.base import CodecAdapter, CodeChunk
from services.stage_worker.codecs.snac import SnacCodecAdapter
from services.stage_worker.codecs.tiny import TinyCodecAdapter

__all__ = ["CodeChunk", "CodecAdapter", "load_codec_adapter"]


def load_codec_adapter(model_dir: Path | str) -> CodecAdapter:
    """The adapter of the codec in ``model_dir``, its family told by its ``config.json``.
    Raises ValueError naming the directory when no family claims it."""
    directory = Path(model_dir)
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"codec model {directory}: cannot read config.json: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"codec model {directory}: config.json is not a JSON object")
    if "vq_strides" in config:
        return SnacCodecAdapter.load(directory)
    if "samples_per_code" in config:
        return TinyCodecAdapter.load(directory)
    raise ValueError(
        f"codec model {directory}: config.json is neither SNAC's (vq_strides) nor tiny-code2wav's "
        "(samples_per_code)"
    )
