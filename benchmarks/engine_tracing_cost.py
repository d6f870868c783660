"""Overhead of engine tracing (docs/contract.md, "Tracing"), measured two ways (a run of each
is in results/engine-tracing/):

- ``scheduler``: vLLM's scheduler (our ``OmniScheduler``) driven without a model: a fake model
  runner feeds one token per request and step, so the loop is pure scheduling and the difference
  between configurations (:data:`CONFIGS`) is the tracing cost per step (spans exported in batches
  to a discarding exporter, on its own thread as in production), compared with tracing off;
- ``engine``: real ``AsyncLLM`` engines on the tiny thinker, tracing off vs on (OTLP/HTTP to a
  local sink that discards), per-request latency of sequential requests and the time of a burst.

Both are presets of the paired runner (:mod:`benchmarks.paired`), each configuration compared with
tracing off. Run: ``omnirelay bench tracing [scheduler|engine|all]``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from benchmarks.paired import Figure, Paired, render, run_paired

SCHEDULER_ROUNDS = 5
ENGINE_ROUNDS = 10

BASELINE = "vLLM AsyncScheduler (no OmniScheduler hooks)"

CONFIGS: dict[str, dict[str, Any] | None] = {
    BASELINE: None,
    "off": None,
    "journey 1.0 (default), step off": {"journey_sample_rate": 1.0},
    "journey 0, step on at defaults (0.01 / 0.001)": {"journey_sample_rate": 0.0, "step_enabled": True},
    "journey 1.0, step on at defaults (0.01 / 0.001)": {"journey_sample_rate": 1.0, "step_enabled": True},
    "journey 1.0, step on at 1.0 / 1.0 (worst case)": {
        "journey_sample_rate": 1.0,
        "step_enabled": True,
        "step_sample_rate": 1.0,
        "rich_subsample_rate": 1.0,
    },
}


# --- scheduler loop -------------------------------------------------------------------------------------


def _discarding_provider(cfg: Any) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return provider


def _scheduler(settings: dict[str, Any] | None, num_blocks: int = 4096, plain: bool = False):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from libs.models.tiny import resolve_model
    from services.stage_worker.engine_core import tracing_config
    from services.stage_worker.engine_core.scheduler import OmniScheduler

    tracing_config.make_tracer_provider = _discarding_provider  # benchmark only
    model = ModelConfig(model=resolve_model("tiny-thinker"), dtype="float32", max_model_len=2048)
    sched_cfg = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=2048, is_encoder_decoder=False
    )
    cache = CacheConfig(block_size=16, enable_prefix_caching=False)
    cache.num_gpu_blocks = num_blocks
    extra = {}
    if settings is not None:
        extra[tracing_config.ADDITIONAL_CONFIG_KEY] = {"endpoint": "http://unused:4318/v1/traces", **settings}
    vc = VllmConfig(
        model_config=model, scheduler_config=sched_cfg, cache_config=cache, additional_config=extra
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    cls = AsyncScheduler if plain else OmniScheduler
    return cls(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=16,
        log_stats=False,
    )


def scheduler_us_per_step(
    settings: dict[str, Any] | None,
    requests: int = 64,
    prompt: int = 64,
    max_tokens: int = 128,
    plain: bool = False,
) -> tuple[float, int]:
    """(µs per schedule + update_from_output, steps) for ``requests`` concurrent requests."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = _scheduler(settings, plain=plain)
    for i in range(requests):
        ids = [10 + (i * 131 + k) % 1500 for k in range(prompt)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(f"r{i}", ids, params, None))
    steps = 0
    t0 = time.perf_counter_ns()
    while sched.has_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if sched.requests[r].is_prefill_chunk else [7] for r in ids]
        runner = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        sched.update_from_output(out, runner)
        steps += 1
    elapsed = time.perf_counter_ns() - t0
    sched.shutdown()
    return elapsed / steps / 1000, steps


SCHEDULER_FIGURES: tuple[Figure[float], ...] = (
    Figure("scheduler step", "µs", lambda us: us),
    Figure("scheduler step, more than off", "µs", lambda us: us, compare="difference"),
)


def bench_scheduler() -> None:
    """Every configuration's µs per scheduler step, against tracing off."""
    print(f"scheduler loop, 64 requests x (64 prompt + 128 output tokens), {SCHEDULER_ROUNDS} paired rounds")
    scheduler_us_per_step(None)  # warm-up

    def one(name: str, settings: None, _: int) -> float:
        return scheduler_us_per_step(CONFIGS[name], plain=name == BASELINE)[0]

    workload = {"64 x (64 + 128)": None}
    paired = asyncio.run(run_paired(list(CONFIGS), workload, SCHEDULER_ROUNDS, one, baseline="off"))
    print(render(paired, SCHEDULER_FIGURES))


# --- real engines ---------------------------------------------------------------------------------------


def _sink() -> ThreadingHTTPServer:
    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def _start(flags: Any):  # -> ThinkerHandler
    from libs.common.pipeline import load_pipeline
    from services.stage_worker.handlers.thinker import ThinkerHandler
    from services.stage_worker.llm_engine import LLMEngineSpec

    pipeline = load_pipeline()
    handler = ThinkerHandler(LLMEngineSpec.for_replica(pipeline, pipeline.thinker_stage, 0, tracing=flags))
    await handler.start()
    return handler


@dataclass(frozen=True)
class EngineRound:
    """One round on one engine: each sequential request's latency and the burst's time, seconds."""

    sequential_s: list[float]
    burst_s: float


ENGINE_FIGURES: tuple[Figure[EngineRound], ...] = (
    Figure("sequential p50", "ms", lambda r: statistics.median(r.sequential_s) * 1e3),
    Figure("sequential p95", "ms", lambda r: statistics.quantiles(r.sequential_s, n=20)[18] * 1e3),
    Figure("burst of 16", "ms", lambda r: r.burst_s * 1e3),
)


async def _round(engine: Any, r: int, sequential: int = 30, burst: int = 16) -> EngineRound:
    """Latencies of ``sequential`` requests one after the other, then the time of a burst."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)

    async def one(k: int) -> float:
        prompt = TokensPrompt(prompt_token_ids=[10 + (k * 7 + i) % 1500 for i in range(32)])
        t0 = time.perf_counter()
        async for _ in engine.generate(prompt, params, uuid.uuid4().hex):
            pass
        return time.perf_counter() - t0

    seq = [await one(100 * r + k) for k in range(sequential)]
    t0 = time.perf_counter()
    await asyncio.gather(*(one(10_000 * r + k) for k in range(burst)))
    return EngineRound(seq, time.perf_counter() - t0)


async def _compare_engines() -> Paired[EngineRound]:
    """Two engines side by side (tracing off, tracing on at the default rates with step tracing
    enabled), used in paired rounds so that load drift hits both alike."""
    from services.stage_worker.engine_core.tracing_config import EngineTracing

    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        os.environ.pop(key, None)
    handlers = {"off": await _start(EngineTracing(step_enabled=True))}  # no exporter: off
    sink = _sink()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink.server_address[1]}"
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
    handlers["on"] = await _start(EngineTracing(step_enabled=True))  # journey 1.0, step 0.01 / 0.001
    try:
        return await run_paired(
            list(handlers),
            {"32 + 32 tokens": None},
            ENGINE_ROUNDS,
            lambda name, _, r: _round(handlers[name].engine, r),
            warmup=lambda name: _round(handlers[name].engine, -1),
            figures=ENGINE_FIGURES,
        )
    finally:
        for h in handlers.values():
            await h.stop()
        sink.shutdown()


def bench_engine() -> None:
    """Tracing on against off, on real engines."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    paired = asyncio.run(_compare_engines())
    print(
        "tiny thinker engine, 32-token prompts, 32 output tokens; tracing on: journey 1.0, step 0.01 / "
        f"0.001 (the defaults); load average {os.getloadavg()[0]:.1f}"
    )
    print(render(paired, ENGINE_FIGURES))


BENCHES: dict[str, Callable[[], None]] = {"scheduler": bench_scheduler, "engine": bench_engine}
