"""NATS header names (one canonical, case-sensitive spelling). Times are wall-clock ns since the
epoch of the writing process; ``Omni-Arrival-Ns`` is the gateway's at HTTP arrival."""

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
    try:
        return int((headers or {})[name])
    except (KeyError, ValueError):
        return None
