"""Codec adapters (:class:`~.base.CodecAdapter`): how code2wav turns a chunk of codec codes into
PCM16 mono. The family comes from the model directory's ``config.json``: ``snac`` (:mod:`.snac`,
with ``vq_strides``) or ``tiny`` (:mod:`.tiny`, ``tiny-code2wav``'s, with ``samples_per_code``).
"""

from __future__ import annotations

import json
from pathlib import Path

from services.stage_worker.codecs.base import CodecAdapter, CodeChunk
from services.stage_worker.codecs.snac import SnacCodecAdapter
from services.stage_worker.codecs.tiny import TinyCodecAdapter

__all__ = ["CodeChunk", "codec_class", "load_codec_adapter"]


def codec_class(model_dir: Path | str) -> type[CodecAdapter]:
    """The adapter class of the codec in ``model_dir``, told by its ``config.json`` alone (no
    weights are read); ValueError naming the directory when no family claims it."""
    directory = Path(model_dir)
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"codec model {directory}: cannot read config.json: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"codec model {directory}: config.json is not a JSON object")
    if "vq_strides" in config:
        return SnacCodecAdapter
    if "samples_per_code" in config:
        return TinyCodecAdapter
    raise ValueError(
        f"codec model {directory}: config.json is neither SNAC's (vq_strides) nor tiny-code2wav's "
        "(samples_per_code)"
    )


def load_codec_adapter(model_dir: Path | str) -> CodecAdapter:
    """The adapter of the codec in ``model_dir`` (see :func:`codec_class`), loaded."""
    return codec_class(model_dir).load(model_dir)
