"""code2wav: a ``codec`` stage that decodes codec codes into PCM16 audio streamed to the client: the
own frames' samples of each chunk (:mod:`services.stage_worker.codecs`)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from libs.common.envelopes import ClientEvent, ClientEventType
from libs.common.pipeline import StageConfig
from libs.models.tiny import resolve_model
from services.stage_worker.codecs import CodeChunk, load_codec_adapter
from services.stage_worker.codecs.batcher import DecodeBatcher
from services.stage_worker.engine_priority import lower_this_thread
from services.stage_worker.handlers.base import StageError, StageHandler
from services.stage_worker.request_context import RequestContext


class Code2WavHandler(StageHandler):
    def __init__(self, stage: StageConfig, nice: int = 0) -> None:
        """``nice``: the decoding thread's nice value."""
        super().__init__()
        self._stage = stage
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="code2wav", initializer=lower_this_thread, initargs=(nice,)
        )
        self._batcher: DecodeBatcher | None = None
        self.sample_rate = 0

    async def start(self) -> None:
        import torch

        torch.set_num_threads(1)
        try:
            codec = load_codec_adapter(resolve_model(self._stage.model))
        except ValueError as e:  # no codec family claims the directory: stop with the reason
            raise SystemExit(f"stage '{self._stage.name}': {e}") from None
        self._batcher = DecodeBatcher(codec, self._pool)
        self.sample_rate = codec.sample_rate

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, req: RequestContext) -> None:
        assert self._batcher is not None, "start() first"
        while True:
            d = await req.next()
            codes = d.task.codes.to_numpy() if d.task.codes is not None else None
            if codes is not None and codes.size:
                chunk = CodeChunk(codes, d.task.offset, d.task.context_before, d.task.context_after)
                try:
                    with self.progress.working():
                        pcm = await self._batcher.decode(chunk)
                    self.progress.advanced()
                except ValueError as e:
                    raise StageError(
                        500, "codec_input_rejected", f"code2wav rejected chunk {d.task.seq}: {e}"
                    ) from e
                if pcm.size:
                    await req.client(
                        ClientEvent(
                            request_id=req.request_id,
                            type=ClientEventType.AUDIO,
                            in_seq=d.task.seq,
                            frames=chunk.own_frames,
                            pcm16=pcm.tobytes(),
                            sample_rate=self.sample_rate,
                        )
                    )
            await req.ack(d)
            if d.task.final:
                await req.client(
                    ClientEvent(
                        request_id=req.request_id,
                        type=ClientEventType.AUDIO_DONE,
                        sample_rate=self.sample_rate,
                        stage_gen_s=time.monotonic() - req.received_s,
                    )
                )
                req.lifecycle("stage_done")
                return
