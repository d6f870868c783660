"""The ``orpheus`` talker protocol on tiny-orpheus in a real vLLM engine (CPU), built the way a talker
worker builds it (``llm_engine.build_async_llm``: the project's scheduler, the protocol's logits
processor).

One engine start (~15-20 s on 2 cores) serves every check: concurrent Orpheus requests yield only
codes each frame position accepts, in whole frames, and end with end_of_speech at the latest at the
documented cap; a request without the protocol's rule in the same engine is left alone.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.inputs import tokens_input
from vllm.sampling_params import RequestOutputKind

from libs.common.pipeline import PipelineConfig
from libs.models.tiny_orpheus import build_tiny_orpheus
from libs.models.tiny_snac import CODEBOOK_SIZE, build_tiny_snac
from services.stage_worker.llm_engine import LLMEngineSpec, build_async_llm
from services.stage_worker.talkers import make_protocol

pytestmark = pytest.mark.integration

MAX_FRAMES_PER_CHAR, MIN_FRAMES = 0.5, 3
TEXTS = ("Hi.", "The weather today is fine.", "A longer sentence, to see the cap of a longer chunk of text.")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    (root / "orpheus").mkdir()
    (root / "snac").mkdir()
    build_tiny_orpheus(root / "orpheus")
    build_tiny_snac(root / "snac")
    return {"orpheus": root / "orpheus", "snac": root / "snac"}


@pytest.fixture(scope="module")
def pipeline(models: dict[str, Path]) -> PipelineConfig:
    engine = {"max_model_len": 1024, "max_num_seqs": 8, "dtype": "float32", "kv_cache_space_gib": 1}
    return PipelineConfig.model_validate(
        {
            "name": "orpheus-test",
            "served_model_name": "orpheus-test",
            "stages": [
                {"name": "thinker", "type": "llm", "model": "unused", "consumes": "text", "emits": "text"},
                {
                    "name": "talker",
                    "type": "llm",
                    "model": str(models["orpheus"]),
                    "consumes": "text",
                    "emits": "codec_codes",
                    "talker": {
                        "protocol": "orpheus",
                        "voice": "leo",
                        "max_frames_per_char": MAX_FRAMES_PER_CHAR,
                        "min_frames": MIN_FRAMES,
                    },
                    "engine": engine,
                },
                {
                    "name": "code2wav",
                    "type": "codec",
                    "model": str(models["snac"]),
                    "consumes": "codec_codes",
                    "emits": "audio",
                },
            ],
        }
    )


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: the engine's output handler lives on the loop of its first
    request, and a request on another loop would find it gone."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(
    loop: asyncio.AbstractEventLoop, pipeline: PipelineConfig, models: dict[str, Path]
) -> Iterator[object]:
    started = time.perf_counter()
    eng = build_async_llm(LLMEngineSpec.for_replica(pipeline, 1, 0), str(models["orpheus"]))
    print(f"tiny-orpheus engine start {time.perf_counter() - started:.1f} s")
    yield eng
    eng.shutdown()
    pending = asyncio.all_tasks(loop)  # the engine's output handler
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


async def collect(eng, prompt_ids: list[int], params: SamplingParams) -> tuple[list[list[int]], str | None]:
    """Every DELTA output's token ids of one request, and its finish reason."""
    deltas, reason = [], None
    async for out in eng.generate(tokens_input(prompt_ids), params, uuid.uuid4().hex):
        deltas.append(list(out.outputs[0].token_ids))
        reason = out.outputs[0].finish_reason
    return deltas, reason


def test_orpheus_requests_yield_whole_frames_of_valid_codes(loop, engine, pipeline, models) -> None:
    protocol = make_protocol(pipeline, 1, str(models["orpheus"]))
    vocab = AutoTokenizer.from_pretrained(str(models["orpheus"])).get_vocab()
    first_audio, end_of_speech = vocab["<custom_token_10>"], vocab["<custom_token_2>"]
    requests = [protocol.request(text, [], seed=i) for i, text in enumerate(TEXTS)]

    async def run_all():
        return await asyncio.gather(*(collect(engine, r.prompt_token_ids, r.params) for r in requests))

    started = time.perf_counter()
    results = loop.run_until_complete(run_all())
    print(f"{len(TEXTS)} concurrent requests: {1000 * (time.perf_counter() - started):.0f} ms")
    for text, (deltas, reason) in zip(TEXTS, results, strict=True):
        tokens = [t for d in deltas for t in d]
        cap = max(MIN_FRAMES, math.ceil(MAX_FRAMES_PER_CHAR * len(text)))
        # the response: audio tokens, each in its frame position's block (from the vocabulary),
        # then end_of_speech on a frame boundary, at the latest after `cap` frames
        assert reason == "stop" and tokens[-1] == end_of_speech, (text, reason, tokens[-3:])
        audio = tokens[:-1]
        print(f"{text!r}: {len(audio) // 7} frames, cap {cap}")
        assert len(audio) % 7 == 0 and 1 <= len(audio) // 7 <= cap, (text, len(audio))
        for i, t in enumerate(audio):
            block = first_audio + (i % 7) * CODEBOOK_SIZE
            assert block <= t < block + CODEBOOK_SIZE, (text, i, t)
        # the protocol's decoder, fed the deltas as they came, gives the same frames
        stream = protocol.code_stream()
        frames = [f for d in deltas for f in stream.feed(d).tolist()]
        assert stream.stopped and len(frames) == len(audio) // 7
        assert [c for f in frames for c in f] == [
            t - first_audio - (i % 7) * CODEBOOK_SIZE for i, t in enumerate(audio)
        ]


def test_a_request_without_the_rule_is_not_constrained(loop, engine, models) -> None:
    vocab = AutoTokenizer.from_pretrained(str(models["orpheus"])).get_vocab()
    first_audio = vocab["<custom_token_10>"]
    params = SamplingParams(
        max_tokens=32,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    deltas, _ = loop.run_until_complete(collect(engine, [vocab["<|begin_of_text|>"], 100, 200, 300], params))
    tokens = [t for d in deltas for t in d]
    assert len(tokens) == 32
    in_place = [
        first_audio + (i % 7) * CODEBOOK_SIZE <= t < first_audio + (i % 7 + 1) * CODEBOOK_SIZE
        for i, t in enumerate(tokens)
    ]
    assert not all(in_place)
