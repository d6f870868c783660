"""The generated tiny thinker and talker load and generate in a real vLLM v1 AsyncLLM (CPU).

Each test starts its own engine (vLLM spawns an EngineCore process; ~10-17 s on 2 cores) and
prints the measured engine start and generation times (visible with ``pytest -s``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from libs.models.tiny import make_tiny, read_talker_meta

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.outputs import CompletionOutput
from vllm.v1.engine.async_llm import AsyncLLM

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tiny(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def small_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 GiB of KV cache per engine (the CPU default is far larger)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


async def start_and_generate(model_dir: Path, prompt: str | dict, params: SamplingParams) -> CompletionOutput:
    """Start an engine on ``model_dir``, run one request to completion, shut the engine down."""
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=2048,
            disable_log_stats=True,
        )
    )
    ready = time.perf_counter()
    try:
        final = None
        async for output in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            final = output
        done = time.perf_counter()
    finally:
        engine.shutdown()
    print(
        f"{model_dir.name}: engine start {ready - started:.1f} s, "
        f"generation {1000 * (done - ready):.0f} ms, shutdown {time.perf_counter() - done:.1f} s"
    )
    assert final is not None and final.finished
    return final.outputs[0]


def test_thinker_generates_text(tiny: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = asyncio.run(start_and_generate(tiny["tiny-thinker"], "The weather today is", params))
    tok = AutoTokenizer.from_pretrained(str(tiny["tiny-thinker"]))
    assert len(out.token_ids) == 16
    assert all(0 <= t < len(tok) for t in out.token_ids)
    # the text is what the model's own tokenizer makes of those tokens (not vLLM's say-so)
    assert out.text and out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_talker_generates_only_codes(tiny: dict[str, Path]) -> None:
    offset = read_talker_meta(tiny["tiny-talker"])["code_offset"]
    code_ids = list(range(offset, offset + 1024))
    params = SamplingParams(
        allowed_token_ids=code_ids, max_tokens=20, detokenize=False, temperature=1.0, seed=7
    )
    prompt = {"prompt_token_ids": [0, 4, 100, 200, 300, 5, offset, offset + 1]}
    out = asyncio.run(start_and_generate(tiny["tiny-talker"], prompt, params))
    assert len(out.token_ids) == 20
    assert all(offset <= t < offset + 1024 for t in out.token_ids)
