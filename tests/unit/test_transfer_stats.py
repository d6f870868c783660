"""Per-hop transfer statistics from headers: exact intervals, clamped cross-clock ones, exemplars."""

from __future__ import annotations

import pytest

from libs.common import headers as h
from services.stage_worker.transfer_stats import transfer_stats

TRACE = "0af7651916cd43dd8448eb211c80319c"


def _headers(tx_start: int, tx_end: int, **extra: str) -> dict[str, str]:
    return {
        h.TX_START_NS: str(tx_start),
        h.TX_END_NS: str(tx_end),
        h.FROM_STAGE: "0",
        h.FROM_REPLICA: "1",
        h.TO_STAGE: "1",
        h.TO_REPLICA: "0",
        **extra,
    }


def test_intervals_from_headers_broker_and_receiver_clocks() -> None:
    hdr = _headers(1_000_000, 1_250_000, traceparent=f"00-{TRACE}-b7ad6b7169203331-01")
    s = transfer_stats(hdr, received_ns=3_250_000, stored_ns=2_000_000, rx_s=0.0001, size_bytes=512)
    assert (s.from_stage, s.from_replica, s.to_stage, s.to_replica, s.size_bytes) == ("0", "1", "1", "0", 512)
    assert s.tx_s == pytest.approx(0.00025) and s.rx_s == 0.0001
    assert s.in_flight_s == pytest.approx(0.002)
    assert s.publish_s == pytest.approx(0.00075) and s.queue_wait_s == pytest.approx(0.00125)
    assert s.publish_s + s.queue_wait_s == pytest.approx(s.in_flight_s)
    assert s.clamped == () and s.trace_id == TRACE


def test_negative_cross_clock_intervals_are_clamped_and_reported() -> None:
    # the receiver's clock is behind the sender's; the broker's is ahead of the receiver's
    s = transfer_stats(_headers(100, 200), received_ns=150, stored_ns=300, rx_s=0.0, size_bytes=1)
    assert (s.in_flight_s, s.queue_wait_s, s.publish_s) == (0.0, 0.0, pytest.approx(1e-7))
    assert set(s.clamped) == {"in_flight", "queue_wait"}


def test_without_stored_timestamp_or_headers() -> None:
    s = transfer_stats(_headers(1, 2), received_ns=3, stored_ns=None, rx_s=0.0, size_bytes=1)
    assert s.publish_s is None and s.queue_wait_s is None and s.trace_id is None
    hdr = _headers(1, 2)
    del hdr[h.FROM_REPLICA]
    assert transfer_stats(hdr, 3, None, 0.0, 1) is None
    assert transfer_stats({}, 3, None, 0.0, 1) is None
