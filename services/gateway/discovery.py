"""Prometheus HTTP service discovery of every live omnirelay service, from ``omni_services``.

Prometheus polls ``GET /prometheus/targets`` (``http_sd_configs``) and gets one target group per
live service instance: its ``host:port``, its metrics path, and ``__meta_omnirelay_*`` labels
(service, pipeline, stage, stage name, replica, instance) that compose/prometheus.yml relabels
into the one label scheme every series carries. A replica that starts is listed within a
heartbeat; one that stops drops out when its registry entry expires, and Prometheus marks its
series stale. Only records that match their key and name a declared (stage, replica) of the
gateway's pipeline are listed (:func:`libs.common.registry.record_problem`): whoever writes
service-discovery data chooses what Prometheus scrapes.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from libs.common.bus_trust import metrics_url_problem
from libs.common.registry import ServiceRecord

META = "__meta_omnirelay_"


def sd_target_group(rec: ServiceRecord) -> dict[str, object] | None:
    """The HTTP SD target group of one service, or None if it registered no metrics URL or one
    Prometheus must not be sent to (:func:`~libs.common.bus_trust.metrics_url_problem`: not
    http(s), no host or port, credentials, a query; the registry views drop such records too,
    this keeps a record that reached here some other way off the targets)."""
    if not rec.metrics_url or metrics_url_problem(rec.metrics_url) is not None:
        return None
    url = urlsplit(rec.metrics_url)
    labels = {
        f"{META}service": rec.service.value,
        f"{META}pipeline": rec.pipeline,
        f"{META}instance": rec.instance,
        f"{META}stage": "" if rec.stage is None else str(rec.stage),
        f"{META}stage_name": rec.stage_name or "",
        f"{META}replica": "" if rec.replica is None else str(rec.replica),
        "__metrics_path__": url.path or "/metrics",
        "__scheme__": url.scheme or "http",
    }
    return {"targets": [url.netloc], "labels": labels}


def sd_targets(records: list[ServiceRecord]) -> list[dict[str, object]]:
    """All target groups, in a stable order."""
    groups = (sd_target_group(r) for r in sorted(records, key=lambda r: r.key))
    return [g for g in groups if g is not None]
