"""Per-hop transfer statistics, computed by the receiving worker from the message headers
(cross-clock intervals that come out negative are clamped to 0, and the clamp reported)."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.common import headers as h
from libs.common.metrics_catalog import MetricSet


@dataclass(frozen=True)
class TransferStats:
    """One transfer (one chunk) between a sender and this worker. Times in seconds."""

    from_stage: str
    from_replica: str
    to_stage: str
    to_replica: str
    size_bytes: int
    tx_s: float
    rx_s: float
    in_flight_s: float
    publish_s: float | None  # tx end → JetStream stored timestamp; None without one
    queue_wait_s: float | None  # stored timestamp → receipt
    clamped: tuple[str, ...] = field(default=())  # the intervals clamped to 0
    trace_id: str | None = None  # from traceparent: the histograms' exemplar


def _cross_clock(name: str, later_ns: int, earlier_ns: int, clamped: list[str]) -> float:
    d = (later_ns - earlier_ns) / 1e9
    if d < 0:
        clamped.append(name)
        return 0.0
    return d


def transfer_stats(
    headers: dict[str, str], received_ns: int, stored_ns: int | None, rx_s: float, size_bytes: int
) -> TransferStats | None:
    """Stats of one received message, or None when its transfer headers are incomplete.
    ``received_ns``: receiver wall clock at receipt; ``stored_ns``: JetStream's stored timestamp
    (broker clock); ``rx_s``: receipt → deserialized (receiver's monotonic clock)."""
    tx_start, tx_end = h.header_int(headers, h.TX_START_NS), h.header_int(headers, h.TX_END_NS)
    edge = [headers.get(k) for k in (h.FROM_STAGE, h.FROM_REPLICA, h.TO_STAGE, h.TO_REPLICA)]
    if tx_start is None or tx_end is None or None in edge:
        return None
    clamped: list[str] = []
    tx = _cross_clock("tx", tx_end, tx_start, clamped)  # one clock: negative only if it stepped
    in_flight = _cross_clock("in_flight", received_ns, tx_end, clamped)
    publish = queue_wait = None
    if stored_ns is not None:
        publish = _cross_clock("publish", stored_ns, tx_end, clamped)
        queue_wait = _cross_clock("queue_wait", received_ns, stored_ns, clamped)
    return TransferStats(
        *edge, size_bytes, tx, rx_s, in_flight, publish, queue_wait, tuple(clamped), _trace_id(headers)
    )


def _trace_id(headers: dict[str, str]) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``)."""
    parts = headers.get(h.TRACEPARENT, "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def record_transfer(m: MetricSet, model_name: str, s: TransferStats) -> None:
    """Feed ``s`` into the ``vllm:omni_transfer_*`` families of an enabled :class:`MetricSet`."""
    edge = (model_name, s.from_stage, s.from_replica, s.to_stage, s.to_replica)
    ex = {"trace_id": s.trace_id} if s.trace_id else None
    m["vllm:omni_transfer_size_bytes"].labels(*edge).observe(s.size_bytes, ex)
    m["vllm:omni_transfer_tx_s"].labels(*edge).observe(s.tx_s, ex)
    m["vllm:omni_transfer_rx_s"].labels(*edge).observe(s.rx_s, ex)
    m["vllm:omni_transfer_in_flight_s"].labels(*edge).observe(s.in_flight_s, ex)
    if s.publish_s is not None:
        m["vllm:omni_transfer_publish_s"].labels(*edge).observe(s.publish_s, ex)
        m["vllm:omni_transfer_queue_wait_s"].labels(*edge).observe(s.queue_wait_s, ex)
    for interval in s.clamped:
        m["vllm:omni_transfer_clock_skew_clamps"].labels(*edge, interval).inc()
