"""The metric catalog: every ``vllm:omni_*`` family omnirelay exports, defined once.

Names, types, labels and buckets follow vLLM-Omni's Prometheus metrics, plus omnirelay's own
families (docs/contract.md, "Metrics: names and labels"). Values are in seconds (``_s``), bytes
(``_bytes``) or counts; counters get ``_total`` from prometheus_client. The families live in
:data:`OMNI_REGISTRY`, out of reach of vLLM's ``unregister_vllm_metrics()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

OMNI_REGISTRY = CollectorRegistry(auto_describe=True)

SECONDS_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    90.0, 120.0, 180.0, 300.0,
)  # fmt: skip
"""0.05 s – 300 s: end-to-end, generation and time-to-first-packet style values."""
SECONDS_FAST_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip
"""0.001 s – 60 s: transfer times and audio underrun (millisecond resolution)."""
RTF_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0,
    3.0, 5.0, 10.0,
)  # fmt: skip
"""Real-time factor. Every bucket list here holds all of vLLM-Omni's edges for the same family
plus finer ones of ours."""
BYTES_BUCKETS = tuple(float(4**k) for k in range(3, 15))
"""64 B – 256 MiB in powers of four: per-transfer payload sizes."""
CONTINUITY_THRESHOLDS_MS = (50, 100, 200)
"""``threshold_ms`` values of ``vllm:omni_audio_continuity_ok_total``."""


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    """Also used for info-style families (``*_info``, value 1, identity in the labels)."""
    HISTOGRAM = "histogram"


class Exporter(StrEnum):
    """The service whose ``/metrics`` carries a family."""

    GATEWAY = "gateway"
    WORKER = "worker"
    ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class Family:
    """One metric family. ``name`` is the exposed name without the counter ``_total`` suffix."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    exporter: Exporter
    buckets: tuple[float, ...] | None = None
    spec: bool = True
    """True for vLLM-Omni's families, False for omnirelay's additions."""
    also: tuple[Exporter, ...] = ()
    """Other services whose ``/metrics`` carry the family too."""

    @property
    def exporters(self) -> tuple[Exporter, ...]:
        return (self.exporter, *self.also)


PIPELINE = ("model_name",)
AUDIO = ("model_name", "stage", "replica")
EDGE = ("model_name", "from_stage", "from_replica", "to_stage", "to_replica")
WORKER = ("model_name", "stage", "replica")

FAMILIES: tuple[Family, ...] = (
    # --- pipeline (gateway) -------------------------------------------------------------------
    Family("vllm:omni_num_requests_running", Kind.GAUGE,
           "Requests admitted and executing in some stage.", PIPELINE, Exporter.GATEWAY),
    Family("vllm:omni_num_requests_waiting", Kind.GAUGE,
           "Requests accepted by the gateway and not yet started by their first stage.", PIPELINE, Exporter.GATEWAY),
    Family("vllm:omni_requests_success", Kind.COUNTER,
           "Requests that ended, by finish reason (stop, length, abort).", (*PIPELINE, "finished_reason"), Exporter.GATEWAY),
    Family("vllm:omni_e2e_request_latency_s", Kind.HISTOGRAM,
           "End-to-end latency from HTTP arrival (Omni-Arrival-Ns) to the last byte written, seconds.",
           PIPELINE, Exporter.GATEWAY, SECONDS_BUCKETS),
    Family("vllm:omni_requests_failed", Kind.COUNTER,
           "Requests that failed, by reason (timeout, stage_error, no_live_replica, queue_full, ...).",
           (*PIPELINE, "reason"), Exporter.GATEWAY, spec=False),
    Family("vllm:omni_slow_reader_aborts", Kind.COUNTER,
           "Streamed responses aborted because the client read too slowly (OMNIRELAY_MAX_BUFFERED_EVENTS, "
           "OMNIRELAY_SLOW_READER_TIMEOUT_S).", PIPELINE, Exporter.GATEWAY, spec=False),
    # --- audio (gateway, client-facing edge) ---------------------------------------------------
    Family("vllm:omni_stale_events_dropped", Kind.COUNTER,
           "Client events dropped by the gateway because they came from an attempt of the stage the "
           "request had moved past.", ("model_name", "stage"), Exporter.GATEWAY, spec=False),
    Family("vllm:omni_bus_messages_rejected", Kind.COUNTER,
           "Bus messages dropped as stale or forged, by reason (subject_mismatch, unknown_request, "
           "ended_request, bad_stage, bad_attempt, wrong_replica, bad_status, bad_record), counted by "
           "the process that dropped them.", (*PIPELINE, "reason"), Exporter.GATEWAY, spec=False,
           also=(Exporter.ORCHESTRATOR,)),
    Family("vllm:omni_client_event_gaps", Kind.COUNTER,
           "Gaps found in the events a stage attempt sent to the gateway (events lost on the way); the "
           "worker sends the lost ones again.", ("model_name", "stage"), Exporter.GATEWAY, spec=False),
    Family("vllm:omni_realtime_sessions", Kind.GAUGE,
           "Realtime sessions (/v1/realtime WebSockets) open now.", PIPELINE, Exporter.GATEWAY, spec=False),
    Family("vllm:omni_realtime_voice_to_voice_s", Kind.HISTOGRAM,
           "Voice-to-voice latency of a realtime turn: the end of the caller's speech (VAD) reaching the "
           "gateway → the first audio delta sent, seconds.", PIPELINE, Exporter.GATEWAY, SECONDS_BUCKETS, spec=False),
    Family("vllm:omni_realtime_interruptions", Kind.COUNTER,
           "Realtime responses cancelled before they completed, by cause: turn_detected (the caller spoke: "
           "barge-in) or client_cancelled (response.cancel).", (*PIPELINE, "cause"), Exporter.GATEWAY, spec=False),
    Family("vllm:omni_audio_ttfp_s", Kind.HISTOGRAM,
           "Time from HTTP arrival to the first audio bytes written to the client, seconds.",
           AUDIO, Exporter.GATEWAY, SECONDS_BUCKETS),
    Family("vllm:omni_audio_duration_s", Kind.HISTOGRAM,
           "Duration of the audio delivered to the client (frames / sample rate), seconds.",
           AUDIO, Exporter.GATEWAY, SECONDS_BUCKETS),
    Family("vllm:omni_audio_rtf", Kind.HISTOGRAM,
           "Real-time factor: the audio stage's generation time for the request / audio duration "
           "(below 1: faster than it plays).", AUDIO, Exporter.GATEWAY, RTF_BUCKETS),
    Family("vllm:omni_audio_client_rtf", Kind.HISTOGRAM,
           "Real-time factor as the client experiences it: HTTP arrival to the last audio chunk at the "
           "gateway / audio duration.", AUDIO, Exporter.GATEWAY, RTF_BUCKETS, spec=False),
    Family("vllm:omni_audio_frames", Kind.COUNTER,
           "Audio frames (samples per channel) delivered to clients.", AUDIO, Exporter.GATEWAY),
    Family("vllm:omni_audio_underrun_s", Kind.HISTOGRAM,
           "Per-request worst player deficit of a real-time playback simulation; > 0 means audible gaps, seconds.",
           AUDIO, Exporter.GATEWAY, SECONDS_FAST_BUCKETS),
    Family("vllm:omni_audio_continuity_ok", Kind.COUNTER,
           "Streamed audio requests whose worst underrun stayed below threshold_ms.",
           (*AUDIO, "threshold_ms"), Exporter.GATEWAY),
    Family("vllm:omni_audio_skipped_requests", Kind.COUNTER,
           "Audio requests that delivered no audio, by reason (no_audio_data, codec_input_rejected, ...).",
           (*AUDIO, "reason"), Exporter.GATEWAY),
    Family("vllm:omni_audio_streams", Kind.COUNTER,
           "Streamed audio requests evaluated for continuity (denominator of continuity_ok).",
           AUDIO, Exporter.GATEWAY, spec=False),
    Family("vllm:omni_audio_late_chunks", Kind.COUNTER,
           "Streamed audio chunks that arrived after the player ran dry (each caused a gap).",
           AUDIO, Exporter.GATEWAY, spec=False),
    # --- transfer (receiving worker, one observation per hop) ---------------------------------
    Family("vllm:omni_transfer_size_bytes", Kind.HISTOGRAM,
           "Serialized payload size of one transfer between stages, bytes.", EDGE, Exporter.WORKER, BYTES_BUCKETS),
    Family("vllm:omni_transfer_tx_s", Kind.HISTOGRAM,
           "Sender time: serialize and hand to NATS (Omni-Tx-End-Ns - Omni-Tx-Start-Ns), seconds.",
           EDGE, Exporter.WORKER, SECONDS_FAST_BUCKETS),
    Family("vllm:omni_transfer_rx_s", Kind.HISTOGRAM,
           "Receiver time: message received to payload deserialized, seconds.", EDGE, Exporter.WORKER, SECONDS_FAST_BUCKETS),
    Family("vllm:omni_transfer_in_flight_s", Kind.HISTOGRAM,
           "Omni-Tx-End-Ns to receipt (publish, broker storage, queue wait, delivery), seconds.",
           EDGE, Exporter.WORKER, SECONDS_FAST_BUCKETS),
    Family("vllm:omni_transfer_publish_s", Kind.HISTOGRAM,
           "Part of in-flight: Omni-Tx-End-Ns to JetStream's stored timestamp, seconds.",
           EDGE, Exporter.WORKER, SECONDS_FAST_BUCKETS, spec=False),
    Family("vllm:omni_transfer_queue_wait_s", Kind.HISTOGRAM,
           "Part of in-flight: JetStream's stored timestamp to receipt (broker queue wait), seconds.",
           EDGE, Exporter.WORKER, SECONDS_FAST_BUCKETS, spec=False),
    Family("vllm:omni_transfer_clock_skew_clamps", Kind.COUNTER,
           "Cross-clock differences that came out negative and were clamped to 0, by interval.",
           (*EDGE, "interval"), Exporter.WORKER, spec=False),
    # --- stages and the bus --------------------------------------------------------------------
    Family("vllm:omni_stage_request_s", Kind.HISTOGRAM,
           "Time a request spent in this stage: first input received → last output sent, seconds.",
           WORKER, Exporter.WORKER, SECONDS_BUCKETS, spec=False),
    Family("vllm:omni_stage_info", Kind.GAUGE,
           "Stage identity: id, name, type and model of each worker.", (*WORKER, "stage_name", "stage_type", "model"),
           Exporter.WORKER, spec=False),
    Family("vllm:omni_input_audio_duration_s", Kind.HISTOGRAM,
           "Duration of the caller's audio of one request the listener transcribed, seconds.",
           WORKER, Exporter.WORKER, SECONDS_BUCKETS, spec=False),
    Family("vllm:omni_asr_rtf", Kind.HISTOGRAM,
           "The listener's real-time factor: time to transcribe a request's audio / the audio's "
           "duration.", WORKER, Exporter.WORKER, RTF_BUCKETS, spec=False),
    Family("vllm:omni_stale_chunks_dropped", Kind.COUNTER,
           "Chunks a stage-1 worker dropped because they came from an attempt of stage 0 that the "
           "request had moved past.", WORKER, Exporter.WORKER, spec=False),
    Family("vllm:omni_bus_messages_terminated", Kind.COUNTER,
           "Malformed bus messages terminated (never redelivered), by reason.", (*WORKER, "reason"),
           Exporter.WORKER, spec=False),
    Family("vllm:omni_bus_consumer_pending", Kind.GAUGE,
           "Messages stored for this worker's consumer and not yet delivered (bus lag).", WORKER,
           Exporter.WORKER, spec=False),
    Family("vllm:omni_bus_consumer_ack_pending", Kind.GAUGE,
           "Messages delivered to this worker and not yet acknowledged.", WORKER, Exporter.WORKER, spec=False),
    Family("vllm:omni_bus_consumer_redelivered", Kind.GAUGE,
           "Messages of this worker's consumer currently being redelivered.", WORKER, Exporter.WORKER, spec=False),
    Family("vllm:omni_bus_dead_lettered", Kind.COUNTER,
           "Messages that reached max_deliver on this worker's consumer (JetStream advisory).", WORKER,
           Exporter.WORKER, spec=False),
    # --- orchestrator ---------------------------------------------------------------------------
    Family("vllm:omni_orchestrator_admission_queue_depth", Kind.GAUGE,
           "Admissions waiting in the requests stream.", PIPELINE, Exporter.ORCHESTRATOR, spec=False),
    Family("vllm:omni_orchestrator_loop_lag_s", Kind.HISTOGRAM,
           "Event-loop lag of the orchestrator (scheduled vs actual wake-up), seconds.", PIPELINE,
           Exporter.ORCHESTRATOR, SECONDS_FAST_BUCKETS, spec=False),
    Family("vllm:omni_replica_evictions", Kind.COUNTER,
           "Stage replicas declared dead while they had work, by reason (exit, stall, engine_dead); once "
           "per replica incarnation.", (*PIPELINE, "stage", "replica", "reason"), Exporter.ORCHESTRATOR, spec=False),
    Family("vllm:omni_requests_migrated", Kind.COUNTER,
           "Requests moved to another replica of a stage because the one they ran on died, by reason "
           "(exit, stall, engine_dead) and phase (queued, in_progress).",
           (*PIPELINE, "stage", "from_replica", "to_replica", "reason", "phase"), Exporter.ORCHESTRATOR, spec=False),
    Family("vllm:omni_orchestrator_admissions", Kind.COUNTER,
           "Admissions handled, by outcome (dispatched, no_live_replica, expired).", (*PIPELINE, "outcome"),
           Exporter.ORCHESTRATOR, spec=False),
)  # fmt: skip

BY_NAME = {f.name: f for f in FAMILIES}

ENGINE_PROCESSES: dict[str, str] = {
    "vllm:omni_engine_core": "VLLM::EngineCore",
    "vllm:omni_engine_worker": "VLLM::Worker",
}
"""Process families of an ``llm`` worker's engine: namespace → the title vLLM gives the process."""


def engine_process_names() -> tuple[str, ...]:
    """Exposed sample names of the engine process families, under each of :data:`ENGINE_PROCESSES`."""
    own = ProcessCollector(pid=lambda: "self", registry=None).collect()
    return tuple(f"{ns}_{s.name}" for ns in ENGINE_PROCESSES for m in own for s in m.samples)


def exposed_names(f: Family) -> tuple[str, ...]:
    """Sample names Prometheus stores for a family (``_total`` for counters, histogram series)."""
    if f.kind == Kind.COUNTER:
        return (f"{f.name}_total",)
    if f.kind == Kind.HISTOGRAM:
        return (f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count")
    return (f.name,)


def markdown_table() -> str:
    """The catalog as a Markdown table (docs/metrics.md is generated from this)."""
    rows = [
        "| name | type | labels | buckets | exported by | origin |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    names = {v: k for k, v in globals().items() if k.endswith("_BUCKETS")}
    for f in FAMILIES:
        shown = exposed_names(f)[0] if f.kind == Kind.COUNTER else f.name
        rows.append(
            f"| `{shown}` | {f.kind.value} | {', '.join(f.labels)} | {names.get(f.buckets, '')} | "
            f"{', '.join(e.value for e in f.exporters)} | {'contract' if f.spec else 'omnirelay'} |"
        )
    return "\n".join(rows)


class MetricSet:
    """The collectors of one exporter's families, registered only when ``enabled`` (``--log-stats``)."""

    def __init__(
        self, exporter: Exporter, enabled: bool, registry: CollectorRegistry = OMNI_REGISTRY
    ) -> None:
        self.enabled = enabled
        mine = [f for f in FAMILIES if exporter in f.exporters] if enabled else []
        self._collectors = {f.name: _build(f, registry) for f in mine}

    def __getitem__(self, name: str):
        return self._collectors[name]


def _build(f: Family, registry: CollectorRegistry):
    if f.kind == Kind.COUNTER:
        return Counter(f.name, f.help, f.labels, registry=registry)
    if f.kind == Kind.GAUGE:
        return Gauge(f.name, f.help, f.labels, registry=registry, multiprocess_mode="livesum")
    return Histogram(f.name, f.help, f.labels, registry=registry, buckets=f.buckets)


if __name__ == "__main__":  # python -m libs.common.metrics_catalog > table for docs/metrics.md
    print(markdown_table())
