"""The ``tiny`` talker protocol: the generated tiny talker's (``tiny-talker``).

Its vocabulary is the thinker's followed by the codec codes, so the prompt of a text chunk is the
chunk's own thinker token ids, and it makes exactly ``codes_per_token`` codes per token (one code
per token of output, restricted to the code range with vLLM's ``allowed_token_ids``). Code ``k`` is
token ``code_offset + k``, from the model's ``omnirelay_talker.json``. No voices, no stop token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from libs.common.pipeline import TalkerConfig, TalkerProtocolName
from services.stage_worker.talkers.base import CodeStream, TalkerOutputError, TalkerProtocol, TalkerRequest

TALKER_VOCAB_FILE = "omnirelay_talker.json"
"""File in the talker's model dir: ``{"code_offset": int, "num_codes": int}``."""


class TinyCodeStream(CodeStream):
    """Each output token is one code: ``token − code_offset``."""

    def __init__(self, offset: int, num_codes: int) -> None:
        self._offset, self._num_codes = offset, num_codes

    def feed(self, token_ids: Sequence[int]) -> np.ndarray:
        codes = np.asarray(token_ids, dtype=np.int64) - self._offset
        if codes.size and (codes.min() < 0 or codes.max() >= self._num_codes):
            raise TalkerOutputError(f"tiny talker emitted a token outside its code range: {list(token_ids)}")
        return codes.astype(np.int32)

    @property
    def stopped(self) -> bool:
        return False


class TinyProtocol(TalkerProtocol):
    name = TalkerProtocolName.TINY
    frame_size = 1

    def __init__(self, config: TalkerConfig, code_offset: int, num_codes: int, codes_per_token: int) -> None:
        super().__init__(config)
        self.code_offset, self.num_codes, self.codes_per_token = code_offset, num_codes, codes_per_token
        self._allowed = list(range(code_offset, code_offset + num_codes))

    @property
    def fixed_codes_per_token(self) -> int:
        return self.codes_per_token

    @classmethod
    def from_model_dir(cls, config: TalkerConfig, model_dir: str, codes_per_token: int) -> TinyProtocol:
        """The protocol of the tiny talker in ``model_dir`` (its code range from ``TALKER_VOCAB_FILE``)."""
        try:
            meta = json.loads((Path(model_dir) / TALKER_VOCAB_FILE).read_text())
            code_range = int(meta["code_offset"]), int(meta["num_codes"])
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"talker model {model_dir}: cannot read {TALKER_VOCAB_FILE}: {e}") from None
        return cls(config, *code_range, codes_per_token=codes_per_token)

    def request(
        self, text: str, token_ids: Sequence[int], *, voice: str | None = None, seed: int | None = None
    ) -> TalkerRequest | None:
        """Prompt: the thinker token ids; exactly ``codes_per_token`` codes per token."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.resolve_voice(voice)
        n = len(token_ids) * self.codes_per_token
        if not n:
            return None
        params = SamplingParams(
            max_tokens=n,
            min_tokens=n,
            seed=seed,
            allowed_token_ids=self._allowed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            **self.sampling_overrides(),
        )
        return TalkerRequest(prompt_token_ids=list(token_ids), params=params, max_codes=n)

    def code_stream(self) -> TinyCodeStream:
        return TinyCodeStream(self.code_offset, self.num_codes)
