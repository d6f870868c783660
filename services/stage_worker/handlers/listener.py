"""The listener: an ``asr`` stage that transcribes the caller's audio with faster-whisper and streams
the transcript to the client, one ``text`` event per segment, as Whisper finds it (one transcription
at a time, on a thread of its own). Decoding is greedy at temperature 0 unless the request asks
otherwise, so a moved request's new attempt skips the segments the client has (``StageTask.resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from libs.common.envelopes import (
    INPUT_SAMPLE_RATE,
    ClientEvent,
    ClientEventType,
    Heard,
    Transcription,
    Usage,
)
from libs.common.pipeline import StageConfig
from libs.models.tiny import resolve_model
from services.stage_worker.engine_priority import lower_this_thread
from services.stage_worker.handlers.base import StageError, StageHandler
from services.stage_worker.request_context import RequestContext

if TYPE_CHECKING:
    from faster_whisper import WhisperModel


@dataclass(frozen=True)
class Listened:
    """One finished transcription: the input's length and the time it took (seconds, monotonic)."""

    audio_s: float
    processing_s: float

    @property
    def rtf(self) -> float:
        """Real-time factor: processing time / audio duration (below 1: faster than real time)."""
        return self.processing_s / self.audio_s if self.audio_s > 0 else 0.0


_END = object()  # the end of a transcription's segments on its queue


class ListenerHandler(StageHandler):
    def __init__(self, stage: StageConfig, on_listened: Callable[[Listened], None], nice: int = 0) -> None:
        """``on_listened``: told of every finished transcription; ``nice``: the transcription
        thread's nice value."""
        super().__init__()
        self._stage = stage
        self._on_listened = on_listened
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="listener", initializer=lower_this_thread, initargs=(nice,)
        )
        self._model: WhisperModel | None = None

    async def start(self) -> None:
        from faster_whisper import WhisperModel

        cfg, path = self._stage.listener, resolve_model(self._stage.model)

        def load() -> WhisperModel:
            return WhisperModel(
                path, device=cfg.device, compute_type=cfg.compute_type, cpu_threads=cfg.cpu_threads
            )

        try:
            self._model = await asyncio.get_running_loop().run_in_executor(self._pool, load)
        except (RuntimeError, ValueError, OSError) as e:  # not a CTranslate2 Whisper directory, ...
            raise SystemExit(f"stage '{self._stage.name}': cannot load '{path}': {e}") from None

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, req: RequestContext) -> None:
        d = await req.next()
        job = d.task.transcription
        if job is None or not job.pcm16 or len(job.pcm16) % 2:
            raise StageError(400, "invalid_audio", "the listener's task carries no whole PCM16 audio")
        await req.client(ClientEvent(request_id=req.request_id, type=ClientEventType.STARTED))
        audio = np.frombuffer(job.pcm16, dtype="<i2").astype(np.float32) / 32768.0
        duration_s = len(audio) / INPUT_SAMPLE_RATE
        skip, tokens, language = len(d.task.resume), 0, ""
        t0 = time.monotonic()
        async with contextlib.aclosing(self._segments(audio, job)) as heard:
            async for seg in heard:
                if isinstance(seg, str):
                    language = seg
                    continue
                tokens += len(seg.tokens)
                if skip:  # the client has it from the attempt before
                    skip -= 1
                    continue
                await req.client(_segment_event(req.request_id, seg))
        listened = Listened(duration_s, time.monotonic() - t0)
        usage = Usage(prompt_tokens=0, completion_tokens=tokens)
        req.span.set_attributes(
            {
                "gen_ai.operation.name": "transcription",
                "gen_ai.usage.output_tokens": tokens,
                "omnirelay.audio.input_s": duration_s,
                "omnirelay.asr.rtf": listened.rtf,
            }
        )
        await req.client(
            ClientEvent(
                request_id=req.request_id,
                type=ClientEventType.TEXT_DONE,
                finish_reason="stop",
                usage=usage,
                heard=Heard(end_s=duration_s, language=language),
            )
        )
        await req.ack(d)
        self._on_listened(listened)
        req.lifecycle("stage_done", finish_reason="stop")

    async def _segments(self, audio: np.ndarray, job: Transcription) -> AsyncIterator[Any]:
        """The transcript of ``audio``: first the language's code, then Whisper's segments as its
        thread finds them. Counted busy while the thread works, one step of progress a segment;
        a caller that stops early stops the thread after the segment under way."""
        assert self._model is not None, "start() first"
        loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        model, cfg = self._model, self._stage.listener

        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                segments, info = model.transcribe(
                    audio,
                    language=job.language or cfg.language,
                    initial_prompt=job.prompt or None,
                    temperature=job.temperature,
                    beam_size=cfg.beam_size,
                    condition_on_previous_text=False,
                )
                put(info.language)
                for seg in segments:
                    put(seg)
                    if stop.is_set():
                        break
                put(_END)
            except Exception as e:  # reported on the event loop, as the request's failure
                put(e)

        done = loop.run_in_executor(self._pool, work)
        try:
            with self.progress.working():
                while (item := await queue.get()) is not _END:
                    if isinstance(item, Exception):
                        raise StageError(500, "transcription_failed", f"the listener failed: {item}")
                    self.progress.advanced()
                    yield item
        finally:
            stop.set()  # the thread ends after its segment under way; the next transcription waits for it
            done.add_done_callback(lambda f: f.exception())


def _segment_event(request_id: str, seg: Any) -> ClientEvent:
    return ClientEvent(
        request_id=request_id,
        type=ClientEventType.TEXT,
        text=seg.text,
        token_ids=list(seg.tokens),
        heard=Heard(
            start_s=seg.start,
            end_s=seg.end,
            avg_logprob=seg.avg_logprob,
            compression_ratio=seg.compression_ratio,
            no_speech_prob=seg.no_speech_prob,
        ),
    )
