"""An ``OmniScheduler`` driven without an engine, for the engine-tracing tests: vLLM's scheduler
built from a real ``VllmConfig`` (the tiny thinker's model config) and a small KV cache, a fake
model runner (one sampled token per finished prefill or decode step), spans in an in-memory
exporter instead of OTLP; and the deterministic sampler's rule computed from first principles.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from libs.models.tiny import resolve_model
from services.stage_worker.engine_core import tracing_config
from services.stage_worker.engine_core.scheduler import OmniScheduler
from services.stage_worker.engine_core.step_tracing import (
    STEP_SPAN_NAME,
)
from services.stage_worker.engine_core.tracing_config import (
    ADDITIONAL_CONFIG_KEY,
    EngineTracingConfig,
)

BLOCK = 16
TOKEN = 7  # what the fake model runner "samples"


# --- shared helpers ---------------------------------------------------------------------------------


def tracing_settings(**overrides: Any) -> dict[str, Any]:
    """What ``build_async_llm`` would put under ``additional_config`` (sha1 samplers)."""
    raw = {"endpoint": "http://127.0.0.1:1/v1/traces", "protocol": "http/protobuf", "sampler": "sha1"}
    return {**raw, **overrides}


@dataclass
class Traced:
    """A scheduler under test and what it exported."""

    sched: OmniScheduler
    exporter: InMemorySpanExporter
    hasher: Any

    def spans(self, name: str | None = None) -> list[Any]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def step_events(self, name: str) -> list[dict[str, Any]]:
        """Events ``name`` of every ended scheduler_steps span, in emission order."""
        spans = sorted(self.spans(STEP_SPAN_NAME), key=lambda s: s.attributes["scheduler_steps.index"])
        return [dict(e.attributes) for s in spans for e in s.events if e.name == name]


def make_scheduler(
    monkeypatch: pytest.MonkeyPatch,
    tracing: dict[str, Any] | None,
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_batched_tokens: int = 512,
    prefix_caching: bool = True,
) -> Traced:
    """An ``OmniScheduler`` with ``tracing`` as its ``additional_config`` settings (None: none)."""
    exporter = InMemorySpanExporter()

    def provider(cfg: EngineTracingConfig) -> TracerProvider:
        p = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
        p.add_span_processor(SimpleSpanProcessor(exporter))
        return p

    monkeypatch.setattr(tracing_config, "make_tracer_provider", provider)
    model = ModelConfig(
        model=resolve_model("tiny-thinker"), dtype="float32", max_model_len=1024, skip_tokenizer_init=True
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=1024,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    extra = {ADDITIONAL_CONFIG_KEY: tracing} if tracing is not None else {}
    vllm_config = VllmConfig(
        model_config=model, scheduler_config=sched_cfg, cache_config=cache, additional_config=extra
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    sched = OmniScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=False,
    )
    init_none_hash(sha256)
    return Traced(sched, exporter, get_request_block_hasher(BLOCK, sha256))


def add(t: Traced, rid: str, prompt: list[int] | int, max_tokens: int, headers: dict | None = None) -> None:
    ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t.sched.add_request(Request(rid, ids, params, None, block_hasher=t.hasher, trace_headers=headers))


@dataclass
class Step:
    output: SchedulerOutput
    step_id: int
    running: list[str]
    """Ids in ``scheduler.running`` right after ``schedule()``."""
    tokens: dict[str, int]
    """Running request id → (output tokens) right after ``schedule()``."""


def step(t: Traced) -> Step:
    """One engine step: schedule, then feed back one token per request that finished its prefill."""
    out = t.sched.schedule()
    snap = Step(
        output=out,
        step_id=t.sched.current_step,
        running=[r.request_id for r in t.sched.running],
        tokens={r.request_id: r.num_output_tokens for r in t.sched.running},
    )
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = t.sched.requests.get(rid)
        sampled.append([] if req is None or req.is_prefill_chunk else [TOKEN])
    runner = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    t.sched.update_from_output(out, runner)
    return snap


def run_until_idle(t: Traced, limit: int = 500) -> list[Step]:
    steps = []
    while t.sched.has_requests():
        steps.append(step(t))
        assert len(steps) < limit, "scheduler did not drain"
    steps.append(step(t))  # one more, empty step (the engine runs one after a request finishes)
    return steps


def check_types(attrs: dict[str, Any], required: dict[str, type], optional: dict[str, type]) -> None:
    for name, typ in required.items():
        assert name in attrs, f"{name} missing from {attrs}"
        assert type(attrs[name]) is typ, f"{name}={attrs[name]!r} is not {typ.__name__}"
    for name, value in attrs.items():
        if name not in required:
            assert name in optional, f"unexpected attribute {name}"
            assert type(value) is optional[name], f"{name}={value!r}"


def check_summary_invariants(s: dict[str, Any]) -> None:
    assert s["step.duration_us"] >= 0
    assert s["step.duration_us"] == (s["step.ts_end_ns"] - s["step.ts_start_ns"]) // 1000
    assert s["queue.running_depth"] >= 0 and s["queue.waiting_depth"] >= 0
    assert s["batch.num_prefill_reqs"] + s["batch.num_decode_reqs"] == s["queue.running_depth"]
    assert s["batch.prefill_tokens"] + s["batch.decode_tokens"] == s["batch.scheduled_tokens"]
    assert 0.0 <= s["kv.usage_gpu_ratio"] <= 1.0
    assert 0 <= s["kv.blocks_free_gpu"] <= s["kv.blocks_total_gpu"]
    expected_free = s["kv.blocks_total_gpu"] * (1 - s["kv.usage_gpu_ratio"])
    assert math.isclose(s["kv.blocks_free_gpu"], expected_free, abs_tol=1.0)


def check_snapshot_invariants(r: dict[str, Any]) -> None:
    assert r["request.phase"] in {"PREFILL", "DECODE"}
    assert (r["request.phase"] == "PREFILL") == (r["request.num_output_tokens"] == 0)
    assert r["request.num_output_tokens"] >= 0 and r["request.num_preemptions"] >= 0
    assert r["request.num_computed_tokens"] >= r["request.num_prompt_tokens"] + r["request.num_output_tokens"]
    assert r["kv.blocks_allocated_gpu"] >= r["kv.blocks_cached_gpu"] >= 0


def documented_sample(seed: int | str, key: object, rate: float) -> bool:
    """The deterministic sampler's rule as docs/engine-tracing.md states it, computed here from
    first principles (not with the code under test): ``key`` is sampled iff the first 8 bytes
    (16 hex digits) of ``sha1(f"{seed}:{key}")``, as an integer, are below ``rate * 2**64``."""
    head = int(hashlib.sha1(f"{seed}:{key}".encode()).hexdigest()[:16], 16)
    return head < rate * 2**64
