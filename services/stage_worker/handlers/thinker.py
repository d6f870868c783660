"""The thinker: an ``llm`` stage that turns a prompt into text, streamed to the client and,
for audio requests, forwarded to the next stage in chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from libs.common.envelopes import ClientEvent, ClientEventType, Sampling, Usage
from libs.common.text_chunks import TextChunker
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.request_context import RequestContext

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput

    from services.stage_worker.inbox import Delivery
    from services.stage_worker.resumed_text import ResumedText

STARTED_DELAY_S = 0.001
"""How long after handing a request to vLLM the thinker sends ``started`` (unless the first
output comes sooner), seconds: sent at once, the gateway's and client's work on it would run first
on the shared front-end core and delay vLLM's hand-off (docs/performance.md)."""


class _StartedNotice:
    """Stage 0's ``started`` client event: sent once, ``STARTED_DELAY_S`` after it is created
    or when :meth:`sent` is awaited, whichever comes first."""

    def __init__(self, req: RequestContext) -> None:
        self._req = req
        self._task: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(STARTED_DELAY_S, self._send)

    def _send(self) -> None:
        if self._task is None:
            event = ClientEvent(request_id=self._req.request_id, type=ClientEventType.STARTED)
            self._task = asyncio.ensure_future(self._req.client(event))
            # Its failure is raised by sent(); mark it seen if no one awaits it.
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def sent(self) -> None:
        """Send it now unless it is under way; returns once it is out (its failure raised here)."""
        self._timer.cancel()
        self._send()
        assert self._task is not None
        await self._task

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


async def _relay(
    req: RequestContext,
    outputs: AsyncGenerator[RequestOutput, None],
    text: ResumedText | None,
    chunker: TextChunker | None,
) -> tuple[int, str | None]:
    """Stream the engine's ``outputs`` to the client and, with a ``chunker``, in chunks to the
    next stage; the tokens generated and the finish reason. ``text``: a resumed attempt's
    decoder, which also checks the stop strings."""
    generated, finish_reason = 0, None
    # The gateway and its client take the response's start while the engine computes.
    started: _StartedNotice | None = _StartedNotice(req)
    try:
        async for out in outputs:
            if started is not None:  # out before any output
                await started.sent()
                started = None
            c = out.outputs[0]
            ids, delta, stop = list(c.token_ids), c.text, None
            if text is not None:
                eos = out.finished and c.finish_reason == "stop"
                ids, delta, stop = text.feed(ids, out.finished, eos)
            generated += len(ids)
            if ids or delta:
                await req.client_text(delta, ids)
            if chunker is not None:
                for chunk in chunker.feed(ids, delta):
                    await req.downstream(token_ids=chunk.token_ids, text=chunk.text, offset=chunk.offset)
            if stop is not None:
                finish_reason = "stop"
                break  # a stop string ended the text: the engine request is aborted
            if out.finished:
                finish_reason = c.finish_reason
        if started is not None:  # no output at all
            await started.sent()
            started = None
    finally:
        if started is not None:
            started.cancel()
        await outputs.aclose()  # ended by a stop string: abort the engine request now
    return generated, finish_reason


def _sampling_params(s: Sampling, max_tokens: int) -> SamplingParams:
    """vLLM's sampling parameters for ``s``, at most ``max_tokens`` (at least 1), streamed as deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max(max_tokens, 1),
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        stop=s.stop or None,
        ignore_eos=s.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )


class ThinkerHandler(LLMHandler):
    async def run(self, req: RequestContext) -> None:
        from vllm.inputs import tokens_input

        from services.stage_worker.resumed_text import ResumedText, engine_params

        d = await req.next()
        task, s = d.task, d.task.sampling
        if s is None:
            raise ValueError("start task without sampling parameters")
        # After a move, the client already has ``task.resume``: go on after it, with what is
        # left of max_tokens (docs/reliability.md).
        resumed = [t for delta in task.resume for t in delta.token_ids]
        left = s.max_tokens - len(resumed)
        params = _sampling_params(s, left)
        forward = not req.is_last_stage  # an audio request: the talker takes the text in chunks
        chunker = TextChunker(self._stage.chunking.tokens, self._stage.chunking.sentence_end)
        if forward:
            # The same deltas cut into the same chunks, numbered as before: those the next stage
            # has are duplicates (Nats-Msg-Id, its inbox), a missing one is sent now.
            for delta in task.resume:
                for chunk in chunker.feed(delta.token_ids, delta.text):
                    await req.downstream(token_ids=chunk.token_ids, text=chunk.text, offset=chunk.offset)
        if left > 0:
            prompt = tokens_input(task.prompt_token_ids + resumed)
            # A resumed attempt's text comes from the fault-free run's decoder, rebuilt here; the
            # engine neither decodes it nor checks the stop strings (resumed_text.py).
            text = None
            if resumed:
                tokenizer = self.engine.get_tokenizer()
                text = ResumedText(tokenizer, req.request_id, task.prompt_token_ids, resumed, params)
                params = engine_params(params)
            # A later attempt's engine request id is its own: an older one may still be winding down.
            engine_id = req.request_id if req.attempt == 1 else f"{req.request_id}-a{req.attempt}"
            outputs = self.generate(prompt, params, engine_id, req.span)
            generated, finish_reason = await _relay(req, outputs, text, chunker if forward else None)
        else:  # the client has every token; only text_done was missing
            await _StartedNotice(req).sent()
            generated, finish_reason = 0, "length"
        generated += len(resumed)
        if forward:
            rest = chunker.flush()
            await req.downstream(final=True, token_ids=rest.token_ids, text=rest.text, offset=rest.offset)
        usage = Usage(prompt_tokens=len(task.prompt_token_ids), completion_tokens=generated)
        await self._done(req, d, s, usage, finish_reason)

    async def _done(
        self, req: RequestContext, d: Delivery, s: Sampling, usage: Usage, finish_reason: str | None
    ) -> None:
        """Set the span's ``gen_ai.*`` attributes, send ``text_done``, ack ``d``, report ``stage_done``."""
        req.span.set_attributes(
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.system": "vllm",
                "gen_ai.request.model": self._spec.pipeline.served_model_name,
                "gen_ai.request.max_tokens": s.max_tokens,
                "gen_ai.request.temperature": s.temperature,
                "gen_ai.request.top_p": s.top_p,
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "gen_ai.response.finish_reasons": [finish_reason or ""],
            }
        )
        await req.client(
            ClientEvent(
                request_id=req.request_id,
                type=ClientEventType.TEXT_DONE,
                finish_reason=finish_reason,
                usage=usage,
            )
        )
        await req.ack(d)
        req.lifecycle("stage_done", finish_reason=finish_reason)
