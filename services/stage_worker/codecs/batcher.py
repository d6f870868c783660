"""Cross-request batching for code2wav: chunks that wait together decode in one forward pass.

No batching window: a chunk that arrives while the decoder is idle is decoded at once; chunks that
arrive while a decode runs wait, and the next decode takes them together, up to the codec's
``max_batch_chunks``. Each request awaits its chunk's audio before its next chunk, so a request's
chunks stay in order.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import numpy as np

from services.stage_worker.codecs.base import CodecAdapter, CodeChunk


class DecodeBatcher:
    """Decodes chunks for many concurrent requests of one worker, in ``executor`` (one thread);
    ``max_batch`` caps the chunks of one pass (default: the codec's ``max_batch_chunks``)."""

    def __init__(self, codec: CodecAdapter, executor: Executor, max_batch: int | None = None) -> None:
        self._codec = codec
        self._executor = executor
        self._max_batch = max_batch or codec.max_batch_chunks
        self._waiting: list[tuple[CodeChunk, asyncio.Future[np.ndarray]]] = []
        self._runner: asyncio.Task[None] | None = None
        self.passes = 0
        """Decode calls made so far (a batch that a bad chunk splits counts once)."""
        self.chunks = 0
        """Chunks those calls took."""

    async def decode(self, chunk: CodeChunk) -> np.ndarray:
        """PCM16 of ``chunk``'s own frames (see :meth:`CodecAdapter.decode`); ValueError if the
        codec rejects this chunk."""
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._waiting.append((chunk, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            taken, self._waiting = self._waiting[: self._max_batch], self._waiting[self._max_batch :]
            taken = [(c, f) for c, f in taken if not f.done()]  # a cancelled request's chunk is skipped
            if not taken:
                continue
            self.passes += 1
            self.chunks += len(taken)
            chunks = [c for c, _ in taken]
            try:
                results = await loop.run_in_executor(self._executor, self._codec.decode_batch, chunks)
            except ValueError:  # some chunk is bad: decode each alone so only its request fails
                for chunk, future in taken:
                    try:
                        pcm = await loop.run_in_executor(self._executor, self._codec.decode_batch, [chunk])
                    except ValueError as e:
                        _settle(future, error=e)
                    else:
                        _settle(future, pcm[0])
                continue
            except Exception as e:  # the decoder failed: every waiting request learns it
                for _, future in taken:
                    _settle(future, error=e)
                continue
            for (_, future), pcm in zip(taken, results, strict=True):
                _settle(future, pcm)


def _settle(
    future: asyncio.Future[np.ndarray], result: np.ndarray | None = None, error: Exception | None = None
) -> None:
    """Give ``future`` its result or error unless its request stopped waiting."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
