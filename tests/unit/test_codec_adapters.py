"""Codec adapters as code2wav uses them: the family chosen from the model directory, the tiny
adapter's bytes unchanged, cross-request batching, and the handler trimming contexts."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from libs.common.envelopes import ClientEventType, NdArray, StageTask, TaskKind
from libs.common.pipeline import StageConfig
from libs.models.codec import decode_to_pcm16, load_codec
from libs.models.tiny import BUILDERS, CODE2WAV, TINY_SNAC
from libs.stack.processes import until
from services.stage_worker.codecs import CodeChunk, codec_class, load_codec_adapter
from services.stage_worker.codecs.batcher import DecodeBatcher
from services.stage_worker.codecs.snac import SnacCodecAdapter
from services.stage_worker.codecs.tiny import TinyCodecAdapter
from services.stage_worker.handlers.code2wav import Code2WavHandler


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny-code2wav and tiny-snac as ``make_tiny`` builds them."""
    dirs = {}
    for model_id in (CODE2WAV, TINY_SNAC):
        dirs[model_id] = tmp_path_factory.mktemp(model_id)
        BUILDERS[model_id](dirs[model_id])
    return dirs


@pytest.fixture(scope="module")
def tiny(model_dirs: dict[str, Path]) -> TinyCodecAdapter:
    adapter = load_codec_adapter(model_dirs[CODE2WAV])
    assert isinstance(adapter, TinyCodecAdapter)
    return adapter


def test_the_family_comes_from_the_model_directory(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    tiny = load_codec_adapter(model_dirs[CODE2WAV])
    assert isinstance(tiny, TinyCodecAdapter)
    assert (tiny.sample_rate, tiny.samples_per_frame, tiny.codebook_sizes, tiny.context) == (
        24000,
        480,
        (1024,),
        (0, 0),
    )
    snac = load_codec_adapter(model_dirs[TINY_SNAC])
    assert isinstance(snac, SnacCodecAdapter)
    assert (snac.sample_rate, snac.samples_per_frame, snac.codes_per_frame, snac.context) == (
        24000,
        2048,
        7,
        (3, 3),
    )
    assert snac.codebook_sizes == (256,) * 7
    assert tiny.max_batch_chunks == snac.max_batch_chunks == 1  # on a CPU (docs/models.md)
    assert codec_class(model_dirs[TINY_SNAC]).context == (3, 3)  # from config.json alone
    assert codec_class(model_dirs[CODE2WAV]).context == (0, 0)
    (tmp_path / "config.json").write_text('{"model_type": "mimi"}')
    with pytest.raises(ValueError, match="neither SNAC's"):
        load_codec_adapter(tmp_path)
    with pytest.raises(ValueError, match=r"cannot read config\.json"):
        load_codec_adapter(tmp_path / "missing")


def test_tiny_adapter_gives_todays_bytes(tiny: TinyCodecAdapter, model_dirs: dict[str, Path]) -> None:
    """Today's decode (``libs.models.codec.decode_to_pcm16``) of the own codes, for [T] and [T, 1]
    codes, with or without contexts around them."""
    model = load_codec(model_dirs[CODE2WAV])
    codes = np.random.default_rng(0).integers(0, 1024, 37).astype(np.int32)
    today = decode_to_pcm16(model, codes)
    assert len(today) == 37 * 480 * 2
    assert tiny.decode(codes, first_frame=5).tobytes() == today
    assert tiny.decode(codes[:, None], first_frame=5).tobytes() == today
    assert tiny.decode(codes, first_frame=5, before=2, after=3).tobytes() == decode_to_pcm16(
        model, codes[2:-3]
    )
    assert tiny.decode(np.zeros(0, dtype=np.int32), first_frame=0).size == 0


def test_tiny_adapter_rejects_bad_codes(tiny: TinyCodecAdapter) -> None:
    codes = np.arange(10, dtype=np.int32)
    codes[6] = 4096
    with pytest.raises(ValueError, match=r"code 4096 at frame 26 position 0 .*0\.\.1023"):
        tiny.decode(codes, first_frame=20)
    with pytest.raises(ValueError, match="integers"):
        tiny.decode(np.zeros(3, dtype=np.float32), first_frame=0)
    with pytest.raises(ValueError, match=r"\[frames, 1\]"):
        tiny.decode(np.zeros((3, 2), dtype=np.int32), first_frame=0)


def test_tiny_adapter_batch_is_each_chunk_alone(tiny: TinyCodecAdapter) -> None:
    rng = np.random.default_rng(1)
    chunks = [CodeChunk(rng.integers(0, 1024, n), 7 * n, 0, 0) for n in (5, 1, 0, 12)]
    together = tiny.decode_batch(chunks)
    assert [t.tobytes() for t in together] == [tiny.decode(c.codes, c.first_frame).tobytes() for c in chunks]


class GatedTiny(TinyCodecAdapter):
    """The tiny adapter recording each forward pass's chunks; the first pass waits for ``gate``."""

    def __init__(self, base: TinyCodecAdapter) -> None:
        super().__init__(base._model)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.passes: list[list[int]] = []

    def _decode_valid(self, chunks: Sequence[CodeChunk]) -> list[np.ndarray]:
        self.passes.append([c.first_frame for c in chunks])
        self.started.set()
        assert self.gate.wait(10)
        return super()._decode_valid(chunks)


async def _until(flag: threading.Event) -> None:
    await until(flag.is_set, "the flag set", every_s=0.001)


async def test_chunks_that_wait_together_decode_in_one_pass(tiny: TinyCodecAdapter) -> None:
    """A chunk on an idle worker decodes at once, alone; chunks of three requests that arrive
    while it runs go together in the next pass; each gets its own audio."""
    codec = GatedTiny(tiny)
    rng = np.random.default_rng(2)
    chunks = [CodeChunk(rng.integers(0, 1024, 4), first, 0, 0) for first in (0, 100, 200, 300)]
    with ThreadPoolExecutor(1) as pool:
        batcher = DecodeBatcher(codec, pool, max_batch=16)
        first = asyncio.create_task(batcher.decode(chunks[0]))
        await _until(codec.started)
        rest = [asyncio.create_task(batcher.decode(c)) for c in chunks[1:]]
        await asyncio.sleep(0.01)
        codec.gate.set()
        results = await asyncio.gather(first, *rest)
    assert codec.passes == [[0], [100, 200, 300]]
    assert (batcher.passes, batcher.chunks) == (2, 4)
    assert [r.tobytes() for r in results] == [tiny.decode(c.codes, c.first_frame).tobytes() for c in chunks]


async def test_a_bad_chunk_fails_only_its_request_and_a_gone_one_is_skipped(tiny: TinyCodecAdapter) -> None:
    codec = GatedTiny(tiny)
    good = CodeChunk(np.arange(4), 0)
    bad = CodeChunk(np.array([1, 2, 5000]), 40)
    gone = CodeChunk(np.arange(3), 80)
    with ThreadPoolExecutor(1) as pool:
        batcher = DecodeBatcher(codec, pool, max_batch=16)
        first = asyncio.create_task(batcher.decode(good))
        await _until(codec.started)
        waiting = [asyncio.create_task(batcher.decode(c)) for c in (good, bad, gone)]
        await asyncio.sleep(0.01)
        waiting[2].cancel()
        codec.gate.set()
        done = await asyncio.gather(first, *waiting, return_exceptions=True)
    assert done[0].tobytes() == done[1].tobytes() == tiny.decode(good.codes, 0).tobytes()
    assert isinstance(done[2], ValueError) and "frame 42" in str(done[2])
    assert isinstance(done[3], asyncio.CancelledError)
    assert all(80 not in p for p in codec.passes)  # the cancelled request's chunk was never decoded


class FakeRequest:
    """What the code2wav handler uses of a RequestContext: its inputs in order, what it sends."""

    def __init__(self, request_id: str, tasks: list[StageTask]) -> None:
        self.request_id = request_id
        self.received_s = time.monotonic()
        self._tasks = deque(tasks)
        self.events: list = []
        self.acked: list[int] = []
        self.lifecycles: list[str] = []

    async def next(self) -> SimpleNamespace:
        return SimpleNamespace(task=self._tasks.popleft())

    async def client(self, event) -> None:
        self.events.append(event)

    async def ack(self, delivery) -> None:
        self.acked.append(delivery.task.seq)

    def lifecycle(self, kind: str) -> None:
        self.lifecycles.append(kind)


def code_chunk(
    request_id: str, seq: int, codes: np.ndarray, offset: int, before: int, after: int, final: bool
):
    return StageTask(
        request_id=request_id,
        gateway_id="gw",
        arrival_ns=0,
        deadline_ns=2**62,
        route=[0, 0, 0],
        kind=TaskKind.CHUNK,
        seq=seq,
        final=final,
        codes=NdArray.of(codes),
        offset=offset,
        context_before=before,
        context_after=after,
    )


async def test_handler_streams_the_own_frames_of_each_chunk(model_dirs: dict[str, Path]) -> None:
    """Two requests on a SNAC code2wav, chunks of up to 2 own frames with up to 3 frames of context:
    each request's audio, in chunk order, is its whole-utterance decode; a last chunk of context only
    sends no audio; everything is acknowledged and the stage reports done."""
    stage = StageConfig(
        name="code2wav", type="codec", model=str(model_dirs[TINY_SNAC]), consumes="codec_codes", emits="audio"
    )
    handler = Code2WavHandler(stage)
    threads = torch.get_num_threads()
    await handler.start()  # sets one intra-op thread for the process, as a code2wav worker runs
    reference = SnacCodecAdapter.load(model_dirs[TINY_SNAC])
    requests, wholes = [], []
    for r in range(2):
        codes = np.random.default_rng(30 + r).integers(0, 256, (7, 7)).astype(np.int32)
        tasks = []
        for seq, (start, end) in enumerate([(0, 2), (2, 4), (4, 6), (6, 7)]):
            lo, hi = max(0, start - 3), min(7, end + 3)
            tasks.append(code_chunk(f"r{r}", seq, codes[lo:hi], start, start - lo, hi - end, final=False))
        tasks.append(code_chunk(f"r{r}", 4, codes[4:7], 7, 3, 0, final=True))  # context only
        requests.append(FakeRequest(f"r{r}", tasks))
        wholes.append(reference.decode(codes, first_frame=0))
    try:
        await asyncio.gather(*(handler.run(req) for req in requests))
    finally:
        await handler.stop()
        torch.set_num_threads(threads)
    for req, whole in zip(requests, wholes, strict=True):
        audio = [e for e in req.events if e.type == ClientEventType.AUDIO]
        assert [e.in_seq for e in audio] == [0, 1, 2, 3]
        pcm = np.frombuffer(b"".join(e.pcm16 for e in audio), dtype="<i2")
        assert len(pcm) == 7 * 2048
        assert np.abs(pcm.astype(np.int32) - whole).max() <= 1  # float32 rounding (test_snac_codec.py)
        assert req.events[-1].type == ClientEventType.AUDIO_DONE and req.events[-1].sample_rate == 24000
        assert req.acked == [0, 1, 2, 3, 4] and req.lifecycles == ["stage_done"]
