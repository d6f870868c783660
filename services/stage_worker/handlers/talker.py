"""The talker: an ``llm`` stage that turns each text chunk into codec codes through the stage's
talker protocol (:mod:`services.stage_worker.talkers`) and forwards them downstream in code chunks,
cut one of two ways (docs/reliability.md, "How a talker request moves"):

- fixed codes per token (``tiny``): chunks of exactly ``chunking.codes`` codes numbered by code
  position (:class:`~services.stage_worker.chunking.CodeChunker`), straddling text chunks;
- variable (``orpheus``): each text chunk makes one segment of frames, cut with the codec's context
  frames (:class:`~services.stage_worker.chunking.FrameChunker`); where each text chunk's code
  chunks start is noted in the request's record before the text chunk before it is acknowledged.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np
from nats.js.kv import KeyValue

from libs.common.bus import requests_kv
from libs.common.envelopes import NdArray, StageTask
from libs.common.record_updates import read_record, update_record
from libs.common.records import RequestRecord
from libs.models.tiny import resolve_model
from services.stage_worker.chunking import CodeChunker, FrameChunk, FrameChunker
from services.stage_worker.codecs import codec_class
from services.stage_worker.handlers.base import StageError
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.inbox import Delivery
from services.stage_worker.llm_engine import LLMEngineSpec
from services.stage_worker.request_context import RequestContext
from services.stage_worker.talkers import make_protocol
from services.stage_worker.talkers.base import TalkerInputError, TalkerProtocol, TalkerRequest, UnknownVoice

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

log = logging.getLogger(__name__)


def chunk_seed(task: StageTask) -> int:
    """The sampling seed of a text chunk's codes: a function of the chunk alone (its position and
    tokens), so a talker that redoes the chunk after a move generates the very codes the one that
    died did, and the code chunks it re-sends are the same (docs/reliability.md)."""
    return zlib.crc32(f"{task.offset}:{task.token_ids}".encode())


class TalkerHandler(LLMHandler):
    def __init__(self, spec: LLMEngineSpec) -> None:
        super().__init__(spec)
        self.protocol: TalkerProtocol | None = None
        self._context = (0, 0)
        """Frames of context (before, after) the next stage's codec needs around a chunk."""
        self._records: KeyValue | None = None

    async def start(self) -> None:
        self.protocol = make_protocol(self._spec.pipeline, self._spec.stage_id, self.model_path)
        if self.protocol.fixed_codes_per_token is None:
            codec_dir = resolve_model(self._spec.pipeline.stages[self._spec.stage_id + 1].model)
            try:
                self._context = codec_class(codec_dir).context
            except ValueError as e:
                raise SystemExit(f"stage '{self._stage.name}': {e}") from None
        await super().start()

    async def first_chunk_seq(self, task: StageTask, records: KeyValue | None) -> int:
        """An attempt that took the request over starts at the code chunk after those of the text
        chunks acknowledged before ``task``."""
        if task.seq == 0:
            return 0
        if self.protocol.fixed_codes_per_token is not None:
            return self._code_chunker(task).next_seq
        return (await self._position(task, records))[0]

    async def run(self, req: RequestContext) -> None:
        if self.protocol.fixed_codes_per_token is not None:
            await self._run_fixed(req)
        else:
            await self._run_segments(req)

    def _talk(self, task: StageTask, voice: str | None) -> TalkerRequest | None:
        """The engine request of a text chunk spoken by ``voice`` (None: the stage's default); a
        text the protocol refuses fails the request (400), and so does a voice it does not have
        (a gateway that resolved it against another pipeline file)."""
        try:
            return self.protocol.request(task.text, task.token_ids, voice=voice, seed=chunk_seed(task))
        except TalkerInputError as e:
            raise StageError(400, "invalid_input", f"text chunk {task.seq} cannot be spoken: {e}") from e
        except UnknownVoice as e:
            raise StageError(400, "invalid_value", str(e)) from e

    async def _voice(self, req: RequestContext) -> str | None:
        """The request's voice as the gateway resolved it (its record's ``voice``; None: the stage's
        default), read once per attempt, so an attempt that takes the request over speaks alike."""
        if not self.protocol.voices:
            return None
        rec = await read_record(await self._records_kv(req), req.request_id, req.first.deadline_ns)
        if rec is None:
            log.warning("request %s: no record to read its voice from; the stage's default", req.request_id)
            return None
        return rec.voice

    def _outputs(
        self, req: RequestContext, task: StageTask, talk: TalkerRequest
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for text chunk ``task`` (engine request ``<id>-<seq>[-a<attempt>]``)."""
        from vllm.inputs import tokens_input

        engine_id = f"{req.request_id}-{task.seq}" + (f"-a{req.attempt}" if req.attempt > 1 else "")
        return self.generate(tokens_input(talk.prompt_token_ids), talk.params, engine_id, req.span)

    # --- fixed codes per token (tiny) ---------------------------------------------------
    def _code_chunker(self, first: StageTask) -> CodeChunker:
        """The code chunker of an attempt whose first text chunk is ``first``."""
        return CodeChunker(
            self._stage.chunking.codes, start=first.offset * self.protocol.fixed_codes_per_token
        )

    async def _run_fixed(self, req: RequestContext) -> None:
        """Codes sent on in chunks numbered by position (:class:`CodeChunker`); a text chunk is
        acknowledged once every code made from it has been sent, so the text chunks left in the
        stream are those a successor must redo, and the first one's ``offset`` says where."""
        per_token = self.protocol.fixed_codes_per_token
        chunker: CodeChunker | None = None
        unsent: deque[tuple[Delivery, int]] = deque()
        """Text chunks not yet acknowledged, with the position after their last code."""

        async def send(seq: int, codes: list[int], final: bool = False) -> None:
            array = NdArray.of(np.asarray(codes, dtype=np.int32))
            await req.downstream(final=final, codes=array, offset=seq * chunker.size)

        async def ack_sent() -> None:  # the text chunks whose codes have all been sent
            while unsent and unsent[0][1] <= chunker.sent_upto:
                await req.ack(unsent.popleft()[0])

        while True:
            d = await req.next()
            if chunker is None:  # the first text chunk of this attempt
                chunker = self._code_chunker(d.task)
                req.continue_from(chunker.next_seq)
                voice = await self._voice(req)
            talk = self._talk(d.task, voice)
            n = talk.max_codes if talk is not None else 0
            unsent.append((d, (d.task.offset * per_token) + n))
            if talk is not None:
                stream = self.protocol.code_stream()
                async for out in self._outputs(req, d.task, talk):
                    for seq, chunk in chunker.feed(stream.feed(out.outputs[0].token_ids).tolist()):
                        await send(seq, chunk)
                        await ack_sent()
            if d.task.final:
                await send(*chunker.flush(), final=True)
                for sent, _ in unsent:
                    await req.ack(sent)
                req.lifecycle("stage_done")
                return
            await ack_sent()

    # --- segments of frames (orpheus) ---------------------------------------------------
    async def _run_segments(self, req: RequestContext) -> None:
        """Each text chunk's frames are one segment, cut by :class:`FrameChunker`. Once its last code
        chunk has been sent, where the next text chunk's code chunks start is noted in the record,
        and only then is the text chunk acknowledged."""
        chunker: FrameChunker | None = None
        while True:
            d = await req.next()
            if chunker is None:  # the first text chunk of this attempt
                seq, frame = await self._position(d.task, await self._records_kv(req))
                chunker = FrameChunker(
                    self._stage.chunking.codes, self._context, self.protocol.frame_size, seq, frame
                )
                req.continue_from(seq)
                voice = await self._voice(req)
            talk = self._talk(d.task, voice)
            if talk is not None:
                stream = self.protocol.code_stream()
                async for out in self._outputs(req, d.task, talk):
                    for chunk in chunker.feed(stream.feed(out.outputs[0].token_ids)):
                        await self._send(req, chunk)
            tail = chunker.end_segment(last=d.task.final)
            for chunk in tail:
                await self._send(req, chunk, final=d.task.final and chunk is tail[-1])
            if d.task.final:
                await req.ack(d)
                req.lifecycle("stage_done")
                return
            await self._note_position(req, d.task.seq + 1, chunker)
            await req.ack(d)

    @staticmethod
    async def _send(req: RequestContext, chunk: FrameChunk, final: bool = False) -> None:
        await req.downstream(
            final=final,
            codes=NdArray.of(chunk.frames),
            offset=chunk.first_frame,
            context_before=chunk.before,
            context_after=chunk.after,
        )

    async def _records_kv(self, req: RequestContext) -> KeyValue:
        if self._records is None:
            self._records = await requests_kv(req.bus.js)
        return self._records

    async def _position(self, first: StageTask, records: KeyValue | None) -> tuple[int, int]:
        """(seq of the first code chunk, absolute index of the first frame) of text chunk
        ``first``'s codes: (0, 0) for text chunk 0, else its position note in the record."""
        if first.seq == 0:
            return 0, 0
        lost = StageError(
            500, "position_lost", f"no position note for text chunk {first.seq} in the request's record"
        )
        if records is None:
            raise lost
        rec = await read_record(records, first.request_id, first.deadline_ns)
        stage = self._spec.stage_id
        notes = rec.stages[stage].code_positions if rec is not None and stage < len(rec.stages) else {}
        if first.seq not in notes:
            raise lost
        return notes[first.seq]

    async def _note_position(self, req: RequestContext, text_seq: int, chunker: FrameChunker) -> None:
        """Note in the record that text chunk ``text_seq``'s code chunks start where ``chunker``
        stands (compare-and-set: the orchestrators write the record too)."""
        stage, code_seq, frame = self._spec.stage_id, chunker.next_seq, chunker.next_frame

        def note(rec: RequestRecord) -> bool:
            if stage >= len(rec.stages):
                return False
            rec.stages[stage].note_code_position(text_seq, code_seq, frame)
            return True

        if not await update_record(await self._records_kv(req), req.request_id, note):
            log.warning("request %s: no record to note text chunk %d's position in", req.request_id, text_seq)
