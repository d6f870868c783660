"""code2wav: a ``codec`` stage that decodes codec codes into PCM16 audio streamed to the client."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from libs.common.envelopes import ClientEvent, ClientEventType
from libs.common.pipeline import StageConfig
from libs.models.codec import decode_to_pcm16, load_codec
from libs.models.tiny import resolve_model
from services.stage_worker.handlers.base import StageError, StageHandler
from services.stage_worker.request_context import RequestContext


class Code2WavHandler(StageHandler):
    def __init__(self, stage: StageConfig) -> None:
        super().__init__()
        self._stage = stage
        self._model = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="code2wav")
        self.sample_rate = 0

    async def start(self) -> None:
        import torch

        torch.set_num_threads(1)
        self._model = load_codec(resolve_model(self._stage.model))
        self.sample_rate = self._model.cfg.sample_rate

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, req: RequestContext) -> None:
        loop = asyncio.get_running_loop()
        while True:
            d = await req.next()
            codes = d.task.codes.to_numpy() if d.task.codes is not None else None
            if codes is not None and codes.size:
                try:
                    with self.progress.working():
                        pcm = await loop.run_in_executor(self._pool, decode_to_pcm16, self._model, codes)
                    self.progress.advanced()
                except ValueError as e:
                    raise StageError(
                        500, "codec_input_rejected", f"code2wav rejected chunk {d.task.seq}: {e}"
                    ) from e
                await req.client(
                    ClientEvent(
                        request_id=req.request_id,
                        type=ClientEventType.AUDIO,
                        in_seq=d.task.seq,
                        pcm16=pcm,
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
