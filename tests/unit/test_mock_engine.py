"""The mock engine (services/stage_worker/mock_engine.py): what it streams, at which pace, how it
ends and is cancelled, and that the pipeline file selects it in the one place engines are built.

Ground truth for the text: the tiny thinker's tokenizer as vLLM loads it, decoding the streamed
ids in one go; for the pace, the event loop's clock."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.inputs import tokens_input
from vllm.sampling_params import RequestOutputKind
from vllm.tokenizers import get_tokenizer

from libs.common.pipeline import MockEngineConfig, PipelineConfigError, load_pipeline
from libs.models.tiny import resolve_model
from services.stage_worker.llm_engine import LLMEngineSpec, build_async_llm
from services.stage_worker.mock_engine import MockAsyncLLM, prompt_token_ids, token_cycle, tokens_due

MOCK_PIPELINE = Path(__file__).resolve().parents[2] / "compose" / "pipelines" / "mock-text.yaml"
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(resolve_model("tiny-thinker"))


def _engine(tokenizer, inter_token_ms: float = 0.0, max_num_seqs: int = 8) -> MockAsyncLLM:
    return MockAsyncLLM(tokenizer, MockEngineConfig(inter_token_ms=inter_token_ms), max_num_seqs)


def _params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kw)


async def _collect(engine: MockAsyncLLM, prompt: list[int], params: SamplingParams, rid: str = "r"):
    return [out async for out in engine.generate(tokens_input(prompt), params, rid)]


async def test_streams_max_tokens_one_per_output_decoded_by_the_real_tokenizer(tokenizer) -> None:
    engine = _engine(tokenizer)
    outs = await _collect(engine, PROMPT, _params(40))
    ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(outs) == 40 and len(ids) == 40
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * 39 + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert all(o.outputs[0].finish_reason is None for o in outs[:-1])
    text = "".join(o.outputs[0].text for o in outs)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.strip(), "the stream carries readable text"
    assert not set(ids) & set(tokenizer.all_special_ids)
    assert all(o.prompt_token_ids == PROMPT for o in outs)
    assert (engine.finished, engine.aborted, engine.running) == (1, 0, 0)


async def test_a_token_is_a_function_of_its_position_so_a_resumed_attempt_continues(tokenizer) -> None:
    engine = _engine(tokenizer)
    whole = [t for o in await _collect(engine, PROMPT, _params(30)) for t in o.outputs[0].token_ids]
    cycle = token_cycle(tokenizer)
    assert whole == [cycle[(len(PROMPT) + k) % len(cycle)] for k in range(30)]
    # A move after 12 tokens: the new attempt's prompt is the prompt and the 12 tokens.
    rest = await _collect(engine, PROMPT + whole[:12], _params(18), "r-a2")
    assert [t for o in rest for t in o.outputs[0].token_ids] == whole[12:]


async def test_a_stop_string_ends_the_text_before_it(tokenizer) -> None:
    engine = _engine(tokenizer)
    free = "".join(o.outputs[0].text for o in await _collect(engine, PROMPT, _params(60)))
    word = "lighthouse"
    assert word in free
    outs = await _collect(engine, PROMPT, _params(60, stop=[word]), "s")
    text = "".join(o.outputs[0].text for o in outs)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == word
    assert text == free[: free.index(word)]
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 60


async def test_no_text_when_the_request_asks_for_none(tokenizer) -> None:
    outs = await _collect(_engine(tokenizer), PROMPT, _params(10, detokenize=False))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 10
    assert all(o.outputs[0].text == "" for o in outs)


async def test_a_paced_engine_merges_the_tokens_a_slow_reader_missed(tokenizer) -> None:
    engine = _engine(tokenizer, inter_token_ms=5.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    sizes = []
    async for out in engine.generate(tokens_input(PROMPT), _params(24), "p"):
        sizes.append(len(out.outputs[0].token_ids))
        await asyncio.sleep(0.03)  # a reader slower than the engine's 5 ms per token
    assert sum(sizes) == 24
    assert len(sizes) < 24 and max(sizes) > 1
    assert loop.time() - t0 >= 24 * 0.005  # the last token is due 120 ms after the start


async def test_a_paced_engine_keeps_its_pace_for_a_fast_reader(tokenizer) -> None:
    engine = _engine(tokenizer, inter_token_ms=4.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    outs = [
        (loop.time() - t0, len(o.outputs[0].token_ids))
        async for o in engine.generate(tokens_input(PROMPT), _params(10), "f")
    ]
    assert sum(n for _, n in outs) == 10
    # No token before its time: an output's last token is due (its position) × 4 ms after the start.
    due = itertools.accumulate(n for _, n in outs)
    assert all(at >= last * 0.004 - 1e-4 for (at, _), last in zip(outs, due, strict=True)), outs
    # Each token on its own, but for a wake-up a loaded box delayed past the next token's time
    # (its two tokens then come together: CI of 2026-11-28 had one such pair in ten); an engine
    # that batched its pace away would send a handful.
    assert len(outs) >= 8, outs


async def test_closing_the_stream_aborts_and_frees_the_slot(tokenizer) -> None:
    engine = _engine(tokenizer, max_num_seqs=1)
    gen = engine.generate(tokens_input(PROMPT), _params(100), "a")
    await anext(gen)
    assert engine.running == 1
    second = asyncio.ensure_future(_collect(engine, PROMPT, _params(5), "b"))
    await asyncio.sleep(0.01)
    assert not second.done(), "one slot: the second request waits"
    await gen.aclose()
    assert (engine.aborted, engine.running) == (1, 0)
    outs = await asyncio.wait_for(second, 5)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert engine.finished == 1


async def test_cancelling_the_reader_aborts(tokenizer) -> None:
    engine = _engine(tokenizer, inter_token_ms=50.0)

    async def read() -> None:
        async for _ in engine.generate(tokens_input(PROMPT), _params(100), "c"):
            pass

    task = asyncio.ensure_future(read())
    await asyncio.sleep(0.12)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.aborted, engine.finished, engine.running) == (1, 0, 0)


async def test_abort_ends_a_running_stream(tokenizer) -> None:
    engine = _engine(tokenizer, inter_token_ms=5.0)
    got = 0
    async for _ in engine.generate(tokens_input(PROMPT), _params(1000), "x"):
        got += 1
        if got == 3:
            await engine.abort("x")
    assert got == 3
    assert (engine.aborted, engine.running) == (1, 0)


async def test_at_most_max_num_seqs_run_at_once(tokenizer) -> None:
    engine = _engine(tokenizer, max_num_seqs=3)
    peak = 0

    async def one(i: int) -> int:
        nonlocal peak
        n = 0
        async for out in engine.generate(tokens_input(PROMPT), _params(20), f"q{i}"):
            peak = max(peak, engine.running)
            n += len(out.outputs[0].token_ids)
        return n

    assert await asyncio.gather(*(one(i) for i in range(8))) == [20] * 8
    assert peak == 3
    assert engine.finished == 8


async def test_refuses_what_it_cannot_serve(tokenizer) -> None:
    engine = _engine(tokenizer)
    with pytest.raises(ValueError, match="DELTA"):
        await anext(engine.generate(PROMPT, SamplingParams(max_tokens=4), "k"))
    gen = engine.generate(PROMPT, _params(4), "dup")
    await anext(gen)
    with pytest.raises(ValueError, match="already running"):
        await anext(engine.generate(PROMPT, _params(4), "dup"))
    await gen.aclose()
    engine.shutdown()
    assert engine.errored
    with pytest.raises(RuntimeError, match="shut down"):
        await anext(engine.generate(PROMPT, _params(4), "late"))


def test_prompt_forms() -> None:
    assert prompt_token_ids(tokens_input([1, 2])) == [1, 2]
    assert prompt_token_ids([3, 4]) == [3, 4]
    with pytest.raises(TypeError):
        prompt_token_ids("text")


@pytest.mark.parametrize(
    ("elapsed", "inter", "produced", "want"),
    [
        (0.0, 0.0, 0, 1),  # unpaced: one more each time
        (9.0, 0.0, 63, 64),
        (9.0, 0.0, 64, 64),  # never past max_tokens
        (0.0099, 0.01, 0, 0),  # the first token is due one interval after the start
        (0.01, 0.01, 0, 1),
        (0.035, 0.01, 1, 3),  # a slow reader gets what is due at once
        (5.0, 0.01, 10, 64),
        (0.0, 0.01, 5, 5),  # never fewer than produced
    ],
)
def test_tokens_due(elapsed: float, inter: float, produced: int, want: int) -> None:
    assert tokens_due(elapsed, inter, produced, 64) == want


def test_the_pipeline_file_selects_it_where_engines_are_built() -> None:
    pipeline = load_pipeline(MOCK_PIPELINE)
    engine = build_async_llm(LLMEngineSpec.for_replica(pipeline, 0, 0), resolve_model("tiny-thinker"))
    assert isinstance(engine, MockAsyncLLM)
    assert not engine.errored


def test_only_a_text_llm_stage_may_be_mocked(tmp_path: Path) -> None:
    stages = """\
  - {name: thinker, type: llm, model: tiny-thinker, consumes: text, emits: text}
  - {name: talker, type: llm, model: tiny-talker, consumes: text, emits: codec_codes,
     engine: {mock: {}}}
  - {name: code2wav, type: codec, model: tiny-code2wav, consumes: codec_codes, emits: audio}
"""
    path = tmp_path / "p.yaml"
    path.write_text(f"name: m\nserved_model_name: m\nstages:\n{stages}")
    with pytest.raises(PipelineConfigError, match=r"engine\.mock"):
        load_pipeline(path)
    path.write_text(
        "name: m\nserved_model_name: m\nstages:\n  - {name: thinker, type: llm, model: tiny-thinker, "
        "consumes: text, emits: text, engine: {mock: {inter_token_ms: -1}}}\n"
    )
    with pytest.raises(PipelineConfigError, match="inter_token_ms"):
        load_pipeline(path)
