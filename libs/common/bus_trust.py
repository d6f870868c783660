"""What a service drops from the bus because it is stale or forged, and the counter of it.

The broker's identities (:mod:`libs.common.nats_identities`) say who may publish on a subject,
not what: every worker may publish on every gateway's ``out`` subjects and write its registry key,
and the orchestrator may send any control message. The application's own checks (the gateway's
:mod:`services.gateway.event_trust`, the registry readers' :func:`libs.common.registry.record_problem`)
drop what no genuine sender would send, and count each message dropped in
``vllm:omni_bus_messages_rejected_total{reason}`` on the process that drops it (docs/security.md,
"What the application checks").
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
    """A client event, or a worker's question, whose subject does not name its request on this
    gateway."""
    UNKNOWN_REQUEST = "unknown_request"
    """A client event or resume question for a request this gateway never held."""
    ENDED_REQUEST = "ended_request"
    """A client event for a request this gateway held and has let go of (its stream ended, or its
    client went away): late events of a live request's last moments land here too."""
    BAD_STAGE = "bad_stage"
    """A stage the pipeline does not declare, or one that does not send that kind of event (text
    only from the listener or the thinker, audio only from the audio stage, nothing but errors without a stage)."""
    BAD_ATTEMPT = "bad_attempt"
    """An attempt the gateway was never told of (a move is announced by the orchestrator's resume
    question before the new attempt starts), or one outside 1 … the stage's migration_limit + 1."""
    WRONG_REPLICA = "wrong_replica"
    """A replica the stage does not declare, or another than the one bound to that (stage, attempt)."""
    BAD_STATUS = "bad_status"
    """An error event whose status is not one the gateway forwards, or whose code is not a plain
    word: the client gets 502 ``bad_status`` with a generic message instead (not dropped: the
    request ends)."""
    BAD_RECORD = "bad_record"
    """A registry record that does not match its key, names a (stage, replica) the pipeline does not
    declare, does not parse, or has a metrics URL Prometheus must not be sent to."""


def rejection_counter(metrics: MetricSet, model: str) -> Callable[[Rejected], None]:
    """A function counting one dropped message by reason (nothing when ``metrics`` is disabled).
    Every reason's series exists from the start at 0, so ``rate()`` and alerts see the first one."""
    if not metrics.enabled:
        return lambda _reason: None
    family = metrics[REJECTED_FAMILY]
    series = {reason: family.labels(model, reason.value) for reason in Rejected}
    return lambda reason: series[reason].inc()


def metrics_url_problem(url: str) -> str | None:
    """Why ``url`` must not become a Prometheus target (None: it may): it must be ``http`` or
    ``https`` with a host and an explicit port, and carry no user name or password, no query and
    no fragment (Prometheus would send the credentials to whoever wrote the record)."""
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
