"""vLLM's stat loggers for an ``llm`` worker, reshaped for a pipeline of (stage, replica) workers.

With ``--log-stats`` the worker's ``AsyncLLM`` gets exactly two stat loggers (see
:func:`stat_loggers_for`):

- :class:`OmniPrometheusStatLogger`, a subclass of vLLM's ``PrometheusStatLogger`` that registers
  every upstream ``vllm:*`` family with the label ``engine`` replaced by ``stage`` + ``replica``
  (this worker's ids), ``model_name`` set to the pipeline's served model name on every family
  (also those upstream registers without it), and an upstream label that would collide with ours
  renamed (``stage`` of ``vllm:num_requests_kv_fetch_by_stage`` becomes ``kv_fetch_stage``).
  It works through the metric-class slots upstream provides (``_gauge_cls``, ``_counter_cls``,
  ``_histogram_cls``, and the same slots of the spec-decode / KV-connector / EC-connector / perf
  helpers): each slot holds a relabelling subclass of the prometheus_client class whose
  ``labels()`` accepts upstream's label values (positional or keyword, ``engine`` as int or str)
  and translates them. Upstream's code runs unchanged.
- :class:`OmniLoggingStatLogger`, vLLM's periodic log line with the prefix
  ``stage <id> (<name>) replica <r>: `` instead of ``Engine 000: ``; :func:`log_stats_periodically`
  calls it every ``log_stats_interval_s`` (vLLM's own timer lives in its API server, which a
  worker does not run).
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

IDENTITY_LABELS = ("model_name", "stage", "replica")
"""Labels every relabelled family starts with, in this order."""

RENAMED_LABELS: dict[str, dict[str, str]] = {
    "vllm:num_requests_kv_fetch_by_stage": {"stage": "kv_fetch_stage"},
}
"""Upstream labels that would collide with ours, per family. A colliding label of a family not
listed here becomes ``upstream_<label>``."""


@dataclass(frozen=True)
class EngineIdentity:
    """Who a worker's engine is, as its metrics and log lines say it."""

    model_name: str
    stage: str
    replica: str
    stage_name: str
    engine_index: int = 0
    """The only engine index the worker's ``AsyncLLM`` has (no data parallelism per worker)."""

    @property
    def label(self) -> str:
        """``stage <id> (<name>) replica <r>``, as the worker's own log lines say it."""
        return f"stage {self.stage} ({self.stage_name}) replica {self.replica}"

    @property
    def log_prefix(self) -> str:
        return f"{self.label}: "

    def check_engine(self, value: object) -> None:
        if str(value) != str(self.engine_index):
            raise ValueError(
                f"{self.log_prefix}vLLM labelled a metric with engine {value!r}; this worker runs "
                f"only engine {self.engine_index}"
            )


def relabel_names(family: str, upstream: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Our label names for an upstream family, and the renames of upstream labels that collide."""
    renames = {
        name: RENAMED_LABELS.get(family, {}).get(name, f"upstream_{name}")
        for name in upstream
        if name in IDENTITY_LABELS[1:]
    }
    rest = tuple(renames.get(n, n) for n in upstream if n not in ("engine", "model_name"))
    return (*IDENTITY_LABELS, *rest), renames


class _Relabel:
    """Mixed into a prometheus_client metric class: creates the family with our label names and
    translates upstream's ``labels(...)`` calls. Children (``_labelvalues`` set) pass through."""

    _identity: ClassVar[EngineIdentity]
    _upstream_labelnames: tuple[str, ...] = ()
    _renames: dict[str, str]

    def __init__(self, name: str, documentation: str = "", labelnames: Any = (), *args: Any, **kwargs: Any):
        if kwargs.get("_labelvalues") is None:
            upstream = tuple(labelnames)
            labelnames, renames = relabel_names(name, upstream)
            self._upstream_labelnames = upstream
            self._renames = renames
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
        ours: dict[str, object] = {
            "model_name": ident.model_name,
            "stage": ident.stage,
            "replica": ident.replica,
        }
        for name, value in given.items():
            if name == "engine":
                ident.check_engine(value)
            elif name != "model_name":
                ours[self._renames.get(name, name)] = value
        return super().labels(**ours)  # type: ignore[misc]


def _relabelled(base: type, identity: EngineIdentity) -> type:
    return type(f"Omni{base.__name__}", (_Relabel, base), {"_identity": identity})


class OmniPrometheusStatLogger(PrometheusStatLogger):
    """vLLM's Prometheus stat logger with ``engine`` → ``stage`` + ``replica``. Use the class
    :func:`prometheus_logger_class` makes for a worker (its metric slots carry the identity)."""

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
    """An :class:`OmniPrometheusStatLogger` subclass whose metric slots relabel for ``identity``.

    It must be a class (not a factory function): vLLM's ``StatLoggerManager`` recognises a custom
    Prometheus logger only by ``issubclass(factory, PrometheusStatLogger)`` and otherwise adds its
    own, unlabelled one beside it.
    """
    gauge, counter, histogram = (_relabelled(c, identity) for c in (Gauge, Counter, Histogram))
    slots = {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram}
    helpers = {
        "_spec_decoding_cls": type("OmniSpecDecodingProm", (SpecDecodingProm,), {"_counter_cls": counter}),
        "_kv_connector_cls": type("OmniKVConnectorProm", (KVConnectorProm,), dict(slots)),
        "_ec_connector_cls": type("OmniECConnectorProm", (ECConnectorProm,), dict(slots)),
        "_perf_metrics_cls": type("OmniPerfMetricsProm", (PerfMetricsProm,), {"_counter_cls": counter}),
    }
    return type(
        "OmniPrometheusStatLogger",
        (OmniPrometheusStatLogger,),
        {**slots, **helpers, "identity": identity},
    )


def logging_logger_class(identity: EngineIdentity) -> type[OmniLoggingStatLogger]:
    """An :class:`OmniLoggingStatLogger` subclass that prefixes its lines for ``identity``."""
    return type("OmniLoggingStatLogger", (OmniLoggingStatLogger,), {"identity": identity})


def stat_loggers_for(identity: EngineIdentity) -> list[StatLoggerFactory]:
    """The ``stat_loggers`` for ``AsyncLLM.from_engine_args``: one Prometheus logger and one
    logging logger. Pass them with ``disable_log_stats=True``: custom loggers switch stats on in
    vLLM by themselves, and ``disable_log_stats=False`` would add vLLM's default logging logger
    (an ``Engine 000:`` line) beside ours."""
    return [prometheus_logger_class(identity), logging_logger_class(identity)]


async def log_stats_periodically(engine: Any, interval_s: float, label: str) -> None:
    """Call ``engine.do_log_stats()`` every ``interval_s`` (what vLLM's API server does every
    ``VLLM_LOG_STATS_INTERVAL``). vLLM logs an idle engine's line at DEBUG level."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await engine.do_log_stats()
        except Exception:
            log.exception("%s: vLLM stats logging failed", label)
