"""The metric catalog: vLLM-Omni's names, labels and buckets (docs/contract.md, "Metrics: names and
labels"); docs in step; gating."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from libs.common.metrics_catalog import (
    BY_NAME,
    BYTES_BUCKETS,
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


UPSTREAM_BUCKETS = {
    "SECONDS_BUCKETS": (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0),
    "SECONDS_FAST_BUCKETS": (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0),
    "RTF_BUCKETS": (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 5.0, 10.0),
    "BYTES_BUCKETS": tuple(float(1024 * 4**k) for k in range(10)),
}
"""vLLM-Omni's bucket edges (its metric definitions module), by the list each of its families uses."""

OURS = {
    "SECONDS_BUCKETS": (
        0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
        90.0, 120.0, 180.0, 300.0,
    ),
    "SECONDS_FAST_BUCKETS": (
        0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        10.0, 30.0, 60.0,
    ),
    "RTF_BUCKETS": (
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0,
        3.0, 5.0, 10.0,
    ),
    "BYTES_BUCKETS": tuple(float(4**k) for k in range(3, 15)),
}  # fmt: skip
"""The whole lists, as docs/metrics.md describes them."""

SPEC_FAMILY_BUCKETS = {
    "vllm:omni_e2e_request_latency_s": "SECONDS_BUCKETS",
    "vllm:omni_audio_ttfp_s": "SECONDS_BUCKETS",
    "vllm:omni_audio_duration_s": "SECONDS_BUCKETS",
    "vllm:omni_audio_rtf": "RTF_BUCKETS",
    "vllm:omni_audio_underrun_s": "SECONDS_FAST_BUCKETS",
    "vllm:omni_transfer_size_bytes": "BYTES_BUCKETS",
    "vllm:omni_transfer_tx_s": "SECONDS_FAST_BUCKETS",
    "vllm:omni_transfer_rx_s": "SECONDS_FAST_BUCKETS",
    "vllm:omni_transfer_in_flight_s": "SECONDS_FAST_BUCKETS",
}
"""The bucket list of every vLLM-Omni histogram (docs/contract.md, "Metrics: names and labels":
SECONDS for e2e, TTFP and durations; FAST for transfers and underrun; RTF for the real-time factor;
bytes for sizes)."""


def test_bucket_lists_are_exactly_as_documented() -> None:
    lists = {
        "SECONDS_BUCKETS": SECONDS_BUCKETS,
        "SECONDS_FAST_BUCKETS": SECONDS_FAST_BUCKETS,
        "RTF_BUCKETS": RTF_BUCKETS,
        "BYTES_BUCKETS": BYTES_BUCKETS,
    }
    assert lists == OURS
    assert all(list(b) == sorted(set(b)) for b in lists.values())


def test_every_spec_histogram_has_every_upstream_edge_of_its_list() -> None:
    assert set(SPEC_FAMILY_BUCKETS) == {n for n, (kind, _) in SPEC_000.items() if kind == Kind.HISTOGRAM}
    for name, which in SPEC_FAMILY_BUCKETS.items():
        assert BY_NAME[name].buckets == OURS[which], name
        missing = set(UPSTREAM_BUCKETS[which]) - set(BY_NAME[name].buckets)
        assert not missing, f"{name} lacks vLLM-Omni's edges {sorted(missing)}"
    assert all(f.buckets for f in FAMILIES if f.kind == Kind.HISTOGRAM)


def test_disabled_set_registers_nothing_and_enabled_registers_its_exporters_families() -> None:
    reg = CollectorRegistry()
    assert not MetricSet(Exporter.GATEWAY, enabled=False, registry=reg).enabled
    assert generate_latest(reg) == b""
    MetricSet(Exporter.GATEWAY, enabled=True, registry=reg)
    text = generate_latest(reg).decode()
    gateway = [f.name for f in FAMILIES if f.exporter == Exporter.GATEWAY]
    assert "vllm:omni_e2e_request_latency_s" in gateway  # the gateway's families are found at all
    assert all(f"# TYPE {n}" in text for n in gateway)
    assert "vllm:omni_transfer" not in text


def test_docs_table_is_generated_from_the_catalog() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    assert markdown_table() in doc
