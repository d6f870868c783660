"""The talker: an ``llm`` stage that turns each text chunk into codec codes through the stage's
talker protocol (:mod:`services.stage_worker.talkers`: the prompt, sampling and stop of each text
chunk, and how output tokens become codes) and forwards them in chunks of ``chunking.codes``."""

from __future__ import annotations

import zlib
from collections import deque

import numpy as np

from libs.common.envelopes import NdArray, StageTask
from services.stage_worker.chunking import CodeChunker
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.inbox import Delivery
from services.stage_worker.llm_engine import LLMEngineSpec
from services.stage_worker.request_context import RequestContext
from services.stage_worker.talkers import TalkerProtocol, make_protocol


def chunk_seed(task: StageTask) -> int:
    """The sampling seed of a text chunk's codes: a function of the chunk alone (its position and
    tokens), so a talker that redoes the chunk after a move generates the very codes the one that
    died did, and the code chunks it re-sends are the same (docs/reliability.md)."""
    return zlib.crc32(f"{task.offset}:{task.token_ids}".encode())


class TalkerHandler(LLMHandler):
    def __init__(self, spec: LLMEngineSpec) -> None:
        super().__init__(spec)
        self.protocol: TalkerProtocol | None = None

    async def start(self) -> None:
        self.protocol = make_protocol(self._spec.pipeline, self._spec.stage_id, self.model_path)
        await super().start()

    def first_chunk_seq(self, task: StageTask) -> int:
        """An attempt that took the request over starts at the code chunk after the codes of the
        text chunks acknowledged before ``task`` (see :class:`CodeChunker`)."""
        return self._chunker(task).next_seq

    def _chunker(self, first: StageTask) -> CodeChunker:
        """The code chunker of an attempt whose first text chunk is ``first``."""
        return CodeChunker(self._stage.chunking.codes, start=first.offset * self._stage.codes_per_token)

    async def run(self, req: RequestContext) -> None:
        """Each text chunk becomes ``codes_per_token`` codes per token, sent on in chunks of
        ``chunking.codes`` numbered by position (:class:`CodeChunker`). A text chunk is
        acknowledged only once every code made from it has been sent: the text chunks left in the
        stream when this replica dies are exactly those a successor must redo, and it can tell
        from the first one's ``offset`` where the code chunks stand."""
        from vllm.inputs import tokens_input

        chunker: CodeChunker | None = None
        unsent: deque[tuple[Delivery, int]] = deque()
        """Text chunks not yet acknowledged, with the position after their last code."""
        while True:
            d = await req.next()
            if chunker is None:  # the first text chunk of this attempt
                chunker = self._chunker(d.task)
                req.continue_from(chunker.next_seq)
            talk = self.protocol.request(d.task.text, d.task.token_ids, seed=chunk_seed(d.task))
            n = talk.max_codes if talk is not None else 0
            unsent.append((d, (d.task.offset * self._stage.codes_per_token) + n))
            if talk is not None:
                prompt = tokens_input(talk.prompt_token_ids)
                sub_id = f"{req.request_id}-{d.task.seq}" + (f"-a{req.attempt}" if req.attempt > 1 else "")
                stream = self.protocol.code_stream()
                async for out in self.generate(prompt, talk.params, sub_id, req.span):
                    codes = stream.feed(out.outputs[0].token_ids).tolist()
                    for seq, chunk in chunker.feed(codes):
                        await req.downstream(
                            codes=NdArray.of(np.asarray(chunk, dtype=np.int32)), offset=seq * chunker.size
                        )
                        while unsent and unsent[0][1] <= chunker.sent_upto:
                            await req.ack(unsent.popleft()[0])
            if d.task.final:
                seq, rest = chunker.flush()
                await req.downstream(
                    final=True, codes=NdArray.of(np.asarray(rest, dtype=np.int32)), offset=seq * chunker.size
                )
                for sent, _ in unsent:
                    await req.ack(sent)
                req.lifecycle("stage_done")
                return
            while unsent and unsent[0][1] <= chunker.sent_upto:  # no codes, or all of them sent
                await req.ack(unsent.popleft()[0])
