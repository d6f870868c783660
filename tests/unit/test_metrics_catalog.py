"""The metric catalog: spec/000 names, labels and buckets; docs in step; gating."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from libs.common.metrics_catalog import (
    BY_NAME,
    FAMILIES,
    RTF_BUCKETS,
    SECONDS_BUCKETS,
    SECONDS_FAST_BUCKETS,
    Exporter,
    Kind,
    MetricSet,
    markdown_table,
)

SPEC_000 = {
    "vllm:omni_num_requests_running": (Kind.GAUGE, ("model_name",)),
    "vllm:omni_num_requests_waiting": (Kind.GAUGE, ("model_name",)),
    "vllm:omni_requests_success": (Kind.COUNTER, ("model_name", "finished_reason")),
    "vllm:omni_e2e_request_latency_s": (Kind.HISTOGRAM, ("model_name",)),
    "vllm:omni_audio_ttfp_s": (Kind.HISTOGRAM, ("model_name", "stage", "replica")),
    "vllm:omni_audio_duration_s": (Kind.HISTOGRAM, ("model_name", "stage", "replica")),
    "vllm:omni_audio_rtf": (Kind.HISTOGRAM, ("model_name", "stage", "replica")),
    "vllm:omni_audio_frames": (Kind.COUNTER, ("model_name", "stage", "replica")),
    "vllm:omni_audio_underrun_s": (Kind.HISTOGRAM, ("model_name", "stage", "replica")),
    "vllm:omni_audio_continuity_ok": (Kind.COUNTER, ("model_name", "stage", "replica", "threshold_ms")),
    "vllm:omni_audio_skipped_requests": (Kind.COUNTER, ("model_name", "stage", "replica", "reason")),
    **{
        f"vllm:omni_transfer_{n}": (
            Kind.HISTOGRAM,
            ("model_name", "from_stage", "from_replica", "to_stage", "to_replica"),
        )
        for n in ("size_bytes", "tx_s", "rx_s", "in_flight_s")
    },
}


def test_every_spec_family_is_defined_exactly() -> None:
    assert {f.name for f in FAMILIES if f.spec} == set(SPEC_000)
    for name, (kind, labels) in SPEC_000.items():
        assert (BY_NAME[name].kind, BY_NAME[name].labels) == (kind, labels), name
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_bucket_families() -> None:
    assert (SECONDS_BUCKETS[0], SECONDS_BUCKETS[-1]) == (0.05, 300.0)
    assert (SECONDS_FAST_BUCKETS[0], SECONDS_FAST_BUCKETS[-1]) == (0.001, 60.0)
    assert RTF_BUCKETS[0] < 0.1 and 1.0 in RTF_BUCKETS
    for name in ("vllm:omni_e2e_request_latency_s", "vllm:omni_audio_ttfp_s"):
        assert BY_NAME[name].buckets == SECONDS_BUCKETS
    for name in ("vllm:omni_transfer_tx_s", "vllm:omni_audio_underrun_s"):
        assert BY_NAME[name].buckets == SECONDS_FAST_BUCKETS
    assert all(f.buckets for f in FAMILIES if f.kind == Kind.HISTOGRAM)


def test_disabled_set_registers_nothing_and_enabled_registers_its_exporters_families() -> None:
    reg = CollectorRegistry()
    assert not MetricSet(Exporter.GATEWAY, enabled=False, registry=reg).enabled
    assert generate_latest(reg) == b""
    MetricSet(Exporter.GATEWAY, enabled=True, registry=reg)
    text = generate_latest(reg).decode()
    gateway = [f.name for f in FAMILIES if f.exporter == Exporter.GATEWAY]
    assert all(f"# TYPE {n}" in text for n in gateway)
    assert "vllm:omni_transfer" not in text


def test_docs_table_is_generated_from_the_catalog() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    assert markdown_table() in doc
