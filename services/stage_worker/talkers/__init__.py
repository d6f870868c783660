"""Talker protocols: how an ``llm`` stage that emits ``codec_codes`` turns text chunks into codes.

A protocol (:class:`~.base.TalkerProtocol`) decides a text chunk's prompt, sampling, stop and cap,
and turns the engine's output token ids into codec codes (:class:`~.base.CodeStream`). The pipeline
YAML chooses one per stage (``talker.protocol``): :mod:`.tiny` (the generated tiny talker's) or
:mod:`.orpheus` (Orpheus TTS's).
"""

from __future__ import annotations

from typing import Any

from libs.common.pipeline import PipelineConfig, StageConfig, TalkerProtocolName
from libs.models.tiny import resolve_model
from services.stage_worker.engine_core.frame_logits import FRAME_LOGITS_PROCESSOR
from services.stage_worker.talkers.base import TalkerProtocol
from services.stage_worker.talkers.orpheus import OrpheusProtocol
from services.stage_worker.talkers.tiny import TinyProtocol


def make_protocol(pipeline: PipelineConfig, stage_id: int, model_dir: str) -> TalkerProtocol:
    """The protocol of talker stage ``stage_id`` whose model is in ``model_dir`` (loads what it
    needs: the tiny talker's code range, or Orpheus's tokenizer and the next stage's codebook size)."""
    stage = pipeline.stages[stage_id]
    cfg = stage.talker
    if cfg.protocol == TalkerProtocolName.TINY:
        return TinyProtocol.from_model_dir(cfg, model_dir, stage.codes_per_token)
    codec = resolve_model(pipeline.stages[stage_id + 1].model)
    return OrpheusProtocol.from_model_dirs(cfg, model_dir, codec)


def engine_args(stage: StageConfig) -> dict[str, Any]:
    """``AsyncEngineArgs`` fields a stage's talker protocol needs: Orpheus's logits processor, and no
    prefix caching (cached blocks shift the logits, so a redo on another replica would make other
    frames); none for ``tiny`` or a non-talker stage."""
    if stage.talker.protocol == TalkerProtocolName.ORPHEUS:
        return {"logits_processors": [FRAME_LOGITS_PROCESSOR], "enable_prefix_caching": False}
    return {}
