"""The talker: an ``llm`` stage that turns each text chunk into codec codes (its output is
restricted to the codec-code token range) and forwards them in chunks of ``chunking.codes``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from libs.common.envelopes import NdArray
from services.stage_worker.chunking import CodeChunker
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.llm_engine import LLMEngineSpec
from services.stage_worker.request_context import RequestContext

TALKER_VOCAB_FILE = "omnirelay_talker.json"
"""File in the talker's model dir: ``{"code_offset": int, "num_codes": int}``."""


def load_code_range(model_dir: str) -> tuple[int, int]:
    """(code_offset, num_codes) of a talker model: code k is token id ``code_offset + k``."""
    path = Path(model_dir) / TALKER_VOCAB_FILE
    try:
        meta = json.loads(path.read_text())
        return int(meta["code_offset"]), int(meta["num_codes"])
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"talker model {model_dir}: cannot read {TALKER_VOCAB_FILE}: {e}") from None


class TalkerHandler(LLMHandler):
    def __init__(self, spec: LLMEngineSpec) -> None:
        super().__init__(spec)
        self._offset = 0
        self._allowed: list[int] = []

    async def start(self) -> None:
        self._offset, num_codes = load_code_range(self.model_path)
        self._allowed = list(range(self._offset, self._offset + num_codes))
        await super().start()

    async def run(self, req: RequestContext) -> None:
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        chunker = CodeChunker(self._stage.chunking.codes)
        while True:
            d = await req.next()
            if d.task.token_ids:
                n = len(d.task.token_ids) * self._stage.codes_per_token
                params = SamplingParams(
                    max_tokens=n,
                    allowed_token_ids=self._allowed,
                    detokenize=False,
                    output_kind=RequestOutputKind.DELTA,
                )
                prompt = tokens_input(d.task.token_ids)
                sub_id = f"{req.request_id}-{d.task.seq}"
                async for out in self.generate(prompt, params, sub_id, req.span):
                    codes = [t - self._offset for t in out.outputs[0].token_ids]
                    for chunk in chunker.feed(codes):
                        await req.downstream(codes=NdArray.of(np.asarray(chunk, dtype=np.int32)))
            if d.task.final:
                rest = np.asarray(chunker.flush(), dtype=np.int32)
                await req.downstream(final=True, codes=NdArray.of(rest))
                await req.ack(d)
                req.lifecycle("stage_done")
                return
            await req.ack(d)
