"""What a service drops from the bus because it is stale or forged, and the counter of it
(``vllm:omni_bus_messages_rejected_total{reason}``, on the process that drops it;
docs/security.md, "What the application checks").
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from urllib.parse import urlsplit

from libs.common.metrics_catalog import MetricSet

REJECTED_FAMILY = "vllm:omni_bus_messages_rejected"


class Rejected(StrEnum):
    """Why a bus message was dropped: the closed set of the family's ``reason`` label."""

    SUBJECT_MISMATCH = "subject_mismatch"
    """A client event or worker's question whose subject does not name its request on this gateway."""
    UNKNOWN_REQUEST = "unknown_request"
    """A client event or resume question for a request this gateway never held."""
    ENDED_REQUEST = "ended_request"
    """A client event for a request this gateway has let go of."""
    BAD_STAGE = "bad_stage"
    """A stage the pipeline does not declare, or one that does not send that kind of event."""
    BAD_ATTEMPT = "bad_attempt"
    """An attempt the gateway was never told of, or one outside 1 … migration_limit + 1."""
    WRONG_REPLICA = "wrong_replica"
    """A replica the stage does not declare, or another than the one bound to that (stage, attempt)."""
    BAD_STATUS = "bad_status"
    """An error event whose status or code the gateway does not forward (the client gets 502)."""
    BAD_RECORD = "bad_record"
    """A registry record that fails :func:`libs.common.registry.record_problem`."""


def rejection_counter(metrics: MetricSet, model: str) -> Callable[[Rejected], None]:
    """A function counting one dropped message by reason; every reason's series starts at 0."""
    if not metrics.enabled:
        return lambda _reason: None
    family = metrics[REJECTED_FAMILY]
    series = {reason: family.labels(model, reason.value) for reason in Rejected}
    return lambda reason: series[reason].inc()


def metrics_url_problem(url: str) -> str | None:
    """Why ``url`` must not become a Prometheus target (None: it may): it must be ``http(s)`` with
    a host and an explicit port, and no credentials, query, fragment or white space."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r} is not http(s)"
    if not parts.hostname:
        return "no host"
    if port is None:
        return "no port"
    if parts.username is not None or parts.password is not None:
        return "credentials in the URL"
    if parts.query or parts.fragment:
        return "a query or fragment"
    if any(c.isspace() for c in url):
        return "white space"
    return None
