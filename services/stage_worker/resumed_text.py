"""The text of a moved thinker request's new attempt, exactly as the fault-free run streams it:
vLLM's incremental detokenizer on the original prompt, fed the resumed tokens, decodes the new
tokens and checks the stop strings, so the engine does neither (:func:`engine_params`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.tokenizers import TokenizerLike


def engine_params(params: SamplingParams) -> SamplingParams:
    """``params`` for the engine of a resumed attempt: no detokenizing, no stop strings."""
    engine = params.clone()
    engine.stop = []
    engine.detokenize = False
    engine.output_text_buffer_length = 0
    return engine


def incremental_detokenizer(
    tokenizer: TokenizerLike | None, request_id: str, prompt_token_ids: list[int], params: SamplingParams
) -> IncrementalDetokenizer:
    """vLLM's incremental detokenizer for one request (decoding nothing when ``tokenizer`` is None)."""
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    return IncrementalDetokenizer.from_new_request(tokenizer, request)


class ResumedText:
    """Decodes a resumed attempt's tokens as the fault-free run decoded them."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        request_id: str,
        prompt_token_ids: list[int],
        resumed_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._detok = incremental_detokenizer(tokenizer, request_id, prompt_token_ids, params)
        self._detok.update(resumed_token_ids, stop_terminated=False)
        self.client_text = self._detok.get_next_output_text(finished=False, delta=True)

    def feed(self, token_ids: list[int], finished: bool, eos: bool) -> tuple[list[int], str, str | None]:
        """The engine's next tokens -> the tokens to send, their text, and the stop string that
        ended it (None: none did)."""
        before = self._detok.num_output_tokens()
        stop = self._detok.update(token_ids, stop_terminated=eos)
        kept = self._detok.output_token_ids[before:]
        return kept, self._detok.get_next_output_text(finished or stop is not None, delta=True), stop
