"""A fake engine for a thinker stage (``engine.mock``): what the ``llm`` handlers use of vLLM's
``AsyncLLM``, answering from no model, so a benchmark measures omnirelay's own ceiling.

Each request streams ``max_tokens`` tokens of :data:`MOCK_TEXT` (the token at sequence position *p*,
prompt included, is ``cycle[p % len]``), never EOS; token *k* is due ``(k + 1) × inter_token_ms``
after the request got one of ``max_num_seqs`` slots (0: one per output, when asked).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from libs.common.pipeline import MockEngineConfig

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

MOCK_TEXT = (
    "The keeper climbed the stairs of the lighthouse at dusk, lit the lamp and watched the ships "
    "pass far out on the grey sea. Every night the wind came in from the west, and every morning "
    "he wrote the weather in his book before he slept."
)
"""The text whose tokens the mock engine streams, cycled."""


def token_cycle(tokenizer: TokenizerLike, text: str = MOCK_TEXT) -> list[int]:
    """``text``'s token ids without special tokens; ValueError when none remain."""
    special = set(tokenizer.all_special_ids)
    ids = [t for t in tokenizer.encode(text, add_special_tokens=False) if t not in special]
    if not ids:
        raise ValueError("the mock engine's text has no ordinary tokens in this tokenizer")
    return ids


def prompt_token_ids(prompt: Any) -> list[int]:
    """The token ids of a prompt (vLLM's ``tokens_input`` mapping, or a list of ids)."""
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, Sequence) and not isinstance(prompt, str):
        return [int(t) for t in prompt]
    raise TypeError(f"the mock engine takes token prompts only, got {type(prompt).__name__}")


def tokens_due(elapsed_s: float, inter_token_s: float, produced: int, max_tokens: int) -> int:
    """Tokens due ``elapsed_s`` after the request got its slot, within ``produced`` … ``max_tokens``
    (with ``inter_token_s`` 0, one more than ``produced``)."""
    if inter_token_s <= 0:
        return min(produced + 1, max_tokens)
    return max(produced, min(int(elapsed_s / inter_token_s + 1e-9), max_tokens))


class MockAsyncLLM:
    """What the ``llm`` handlers call on vLLM's ``AsyncLLM``, served without a model."""

    def __init__(
        self, tokenizer: TokenizerLike, config: MockEngineConfig, max_num_seqs: int, label: str = "mock"
    ) -> None:
        self._tokenizer = tokenizer
        self._cycle = token_cycle(tokenizer)
        self._inter_token_s = config.inter_token_ms / 1000
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._shut_down = False
        self.label = label
        self.finished = 0  # requests that ran to their end (length or stop)
        self.aborted = 0  # requests closed, cancelled or aborted before their end

    @property
    def errored(self) -> bool:
        return self._shut_down

    @property
    def running(self) -> int:
        return len(self._running)

    def get_tokenizer(self) -> TokenizerLike:
        return self._tokenizer

    async def do_log_stats(self) -> None:
        """Nothing to log: vLLM's stats do not exist here."""

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """End the streams of the running requests ``request_id`` (without a further output)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._aborted.update(i for i in ids if i in self._running)

    def shutdown(self) -> None:
        self._shut_down = True

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
        **_: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``sampling_params.max_tokens`` tokens as ``RequestOutput`` deltas."""
        from services.stage_worker.resumed_text import incremental_detokenizer

        self._check_request(sampling_params, request_id)
        ids = prompt_token_ids(prompt)
        max_tokens = sampling_params.max_tokens or 16
        loop, inter = asyncio.get_running_loop(), self._inter_token_s
        ended = False
        async with self._slots:
            self._running.add(request_id)
            try:
                tokenizer = self._tokenizer if sampling_params.detokenize else None
                detok = incremental_detokenizer(tokenizer, request_id, ids, sampling_params)
                t0, produced = loop.time(), 0
                while produced < max_tokens:
                    if inter <= 0:
                        await asyncio.sleep(0)  # one token per output, when the caller asks
                    while (due := tokens_due(loop.time() - t0, inter, produced, max_tokens)) <= produced:
                        await asyncio.sleep(t0 + (produced + 1) * inter - loop.time())
                    if request_id in self._aborted:
                        break
                    start = len(ids) + produced
                    new = [self._cycle[(start + k) % len(self._cycle)] for k in range(due - produced)]
                    produced = due
                    sent = detok.num_output_tokens()
                    stop = detok.update(new, False)
                    finish = "stop" if stop is not None else "length" if produced >= max_tokens else None
                    ended = finish is not None
                    yield _output(request_id, ids, detok, sent, finish, stop)
                    if ended:
                        break
            finally:
                self._running.discard(request_id)
                self._aborted.discard(request_id)
                if ended:
                    self.finished += 1
                else:
                    self.aborted += 1

    def _check_request(self, sampling_params: SamplingParams, request_id: str) -> None:
        """Raise when the engine is shut down, the outputs are not DELTA or ``request_id`` is running."""
        from vllm.sampling_params import RequestOutputKind

        if self._shut_down:
            raise RuntimeError(f"{self.label}: the mock engine is shut down")
        if sampling_params.output_kind != RequestOutputKind.DELTA:
            raise ValueError(f"{self.label}: the mock engine streams DELTA outputs only")
        if request_id in self._running:
            raise ValueError(f"request id {request_id} already running")


def _output(
    request_id: str,
    ids: list[int],
    detok: IncrementalDetokenizer,
    sent: int,
    finish: str | None,
    stop: str | None,
) -> RequestOutput:
    """The ``RequestOutput`` delta of ``detok``'s tokens after the first ``sent`` (finished with ``finish``)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(
        index=0,
        text=detok.get_next_output_text(finish is not None, delta=True),
        token_ids=list(detok.output_token_ids[sent:]),
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish,
        stop_reason=stop,
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=ids,
        prompt_logprobs=None,
        outputs=[completion],
        finished=finish is not None,
    )


def build_mock_engine(
    model_path: str, config: MockEngineConfig, max_num_seqs: int, label: str
) -> MockAsyncLLM:
    """The mock engine of a stage (logged once, so a run on it is never mistaken for vLLM's)."""
    log.warning(
        "%s: MOCK ENGINE (engine.mock): no model runs; %s, at most %d requests at once",
        label,
        "one token per output, as fast as the worker takes them"
        if config.inter_token_ms <= 0
        else f"a token every {config.inter_token_ms:g} ms",
        max_num_seqs,
    )
    from vllm.tokenizers import get_tokenizer

    return MockAsyncLLM(get_tokenizer(model_path), config, max_num_seqs, label)
