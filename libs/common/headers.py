"""NATS header names (one canonical, case-sensitive spelling) and helpers to read them.

Times are wall-clock nanoseconds since the Unix epoch (``time.time_ns()``) of the process that
wrote them; ``Omni-Arrival-Ns`` is the gateway's clock at HTTP arrival, the anchor of every
request latency.
"""

from __future__ import annotations

REQUEST_ID = "Omni-Request-Id"
ARRIVAL_NS = "Omni-Arrival-Ns"
FROM_STAGE = "Omni-From-Stage"
FROM_REPLICA = "Omni-From-Replica"
TO_STAGE = "Omni-To-Stage"
TO_REPLICA = "Omni-To-Replica"
SEQ = "Omni-Seq"
FINAL = "Omni-Final"
TX_START_NS = "Omni-Tx-Start-Ns"
TX_END_NS = "Omni-Tx-End-Ns"
PAYLOAD_BYTES = "Omni-Payload-Bytes"
TRACEPARENT = "traceparent"
MSG_ID = "Nats-Msg-Id"

FROM_ORCHESTRATOR = "orchestrator"
"""Value of ``Omni-From-Stage``/``-Replica`` when the orchestrator dispatches stage 0."""


def header_int(headers: dict[str, str] | None, name: str) -> int | None:
    """Integer value of header ``name``, or None when absent or not an integer."""
    if not headers or name not in headers:
        return None
    try:
        return int(headers[name])
    except ValueError:
        return None


def header_bool(headers: dict[str, str] | None, name: str) -> bool:
    """``true``/``1`` → True; anything else or absent → False."""
    return bool(headers) and headers.get(name, "").lower() in ("true", "1")
