"""vLLM's stat loggers for an ``llm`` worker (:func:`stat_loggers_for`): every ``vllm:*`` family
with ``stage`` + ``replica`` instead of ``engine`` and the served ``model_name``, through the metric
class slots of vLLM's ``PrometheusStatLogger`` (upstream's code runs unchanged); vLLM's periodic
log line prefixed with the worker's stage and replica (:func:`log_stats_periodically`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerFactory
from vllm.v1.metrics.perf import PerfMetricsProm
from vllm.v1.spec_decode.metrics import SpecDecodingProm

log = logging.getLogger(__name__)

IDENTITY_LABELS = ("model_name", "stage", "replica")  # every relabelled family's first labels

RENAMED_LABELS: dict[str, dict[str, str]] = {
    "vllm:num_requests_kv_fetch_by_stage": {"stage": "kv_fetch_stage"}
}
"""Upstream labels that would collide with ours, per family (otherwise ``upstream_<label>``)."""


@dataclass(frozen=True)
class EngineIdentity:
    """Who a worker's engine is, as its metrics and log lines say it."""

    model_name: str
    stage: str
    replica: str
    stage_name: str
    engine_index: int = 0  # the only engine index a worker's AsyncLLM has

    @property
    def label(self) -> str:
        return f"stage {self.stage} ({self.stage_name}) replica {self.replica}"

    @property
    def log_prefix(self) -> str:
        return f"{self.label}: "


class _Relabel:
    """Mixed into a prometheus_client metric class: our label names, upstream's ``labels()`` calls
    translated (children, ``_labelvalues`` set, pass through)."""

    _identity: ClassVar[EngineIdentity]
    _upstream_labelnames: tuple[str, ...] = ()
    _renames: dict[str, str]

    def __init__(self, name: str, documentation: str = "", labelnames: Any = (), *args: Any, **kwargs: Any):
        if kwargs.get("_labelvalues") is None:
            upstream = self._upstream_labelnames = tuple(labelnames)
            self._renames = {
                n: RENAMED_LABELS.get(name, {}).get(n, f"upstream_{n}")
                for n in upstream
                if n in IDENTITY_LABELS[1:]
            }
            rest = (self._renames.get(n, n) for n in upstream if n not in ("engine", "model_name"))
            labelnames = (*IDENTITY_LABELS, *rest)
        super().__init__(name, documentation, labelnames, *args, **kwargs)  # type: ignore[call-arg]

    def labels(self, *labelvalues: object, **labelkwargs: object):
        if labelvalues and labelkwargs:
            raise ValueError("Can't pass both *args and **kwargs")
        upstream = self._upstream_labelnames
        if labelkwargs:
            given = labelkwargs
            if sorted(given) != sorted(upstream):
                raise ValueError(f"Incorrect label names for {self}: {sorted(given)} != {sorted(upstream)}")
        else:
            if len(labelvalues) != len(upstream):
                raise ValueError(f"Incorrect label count for {self}: {labelvalues} for {upstream}")
            given = dict(zip(upstream, labelvalues, strict=True))
        ident = self._identity
        ours: dict[str, object] = dict(model_name=ident.model_name, stage=ident.stage, replica=ident.replica)
        for name, value in given.items():
            if name == "engine" and str(value) != str(ident.engine_index):
                raise ValueError(
                    f"{ident.log_prefix}vLLM labelled a metric with engine {value!r}; this worker runs "
                    f"only engine {ident.engine_index}"
                )
            if name not in ("engine", "model_name"):
                ours[self._renames.get(name, name)] = value
        return super().labels(**ours)  # type: ignore[misc]


class OmniPrometheusStatLogger(PrometheusStatLogger):
    """vLLM's Prometheus stat logger with ``engine`` → ``stage`` + ``replica``; use
    :func:`prometheus_logger_class`'s subclass."""

    identity: ClassVar[EngineIdentity]

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None):
        if engine_indexes is not None and list(engine_indexes) != [self.identity.engine_index]:
            raise ValueError(
                f"{self.identity.log_prefix}one engine per worker expected, vLLM has engines {engine_indexes}"
            )
        super().__init__(vllm_config, engine_indexes)


class OmniLoggingStatLogger(LoggingStatLogger):
    """vLLM's periodic stats log line, prefixed with the worker's stage and replica."""

    identity: ClassVar[EngineIdentity]

    @property
    def log_prefix(self) -> str:
        return self.identity.log_prefix

    def _log_prefix_for_engine(self, engine_idx: int) -> str:
        return self.identity.log_prefix


def prometheus_logger_class(identity: EngineIdentity) -> type[OmniPrometheusStatLogger]:
    """An :class:`OmniPrometheusStatLogger` subclass whose metric slots relabel for ``identity``
    (a class: vLLM recognises a custom Prometheus logger only by ``issubclass``)."""
    gauge, counter, histogram = (
        type(f"Omni{c.__name__}", (_Relabel, c), {"_identity": identity}) for c in (Gauge, Counter, Histogram)
    )
    slots = {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram}
    helpers = {
        "_spec_decoding_cls": type("OmniSpecDecodingProm", (SpecDecodingProm,), {"_counter_cls": counter}),
        "_kv_connector_cls": type("OmniKVConnectorProm", (KVConnectorProm,), dict(slots)),
        "_ec_connector_cls": type("OmniECConnectorProm", (ECConnectorProm,), dict(slots)),
        "_perf_metrics_cls": type("OmniPerfMetricsProm", (PerfMetricsProm,), {"_counter_cls": counter}),
    }
    return type(
        "OmniPrometheusStatLogger", (OmniPrometheusStatLogger,), {**slots, **helpers, "identity": identity}
    )


def stat_loggers_for(identity: EngineIdentity) -> list[StatLoggerFactory]:
    """The ``stat_loggers`` for ``AsyncLLM``: one Prometheus logger and one logging logger. Pass
    them with ``disable_log_stats=True`` (False would add vLLM's ``Engine 000:`` line beside ours)."""
    logging_cls = type("OmniLoggingStatLogger", (OmniLoggingStatLogger,), {"identity": identity})
    return [prometheus_logger_class(identity), logging_cls]


async def log_stats_periodically(engine: Any, interval_s: float, label: str) -> None:
    """Call ``engine.do_log_stats()`` every ``interval_s``, as vLLM's API server does."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await engine.do_log_stats()
        except Exception:
            log.exception("%s: vLLM stats logging failed", label)
