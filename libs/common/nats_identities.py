"""Least-privilege NATS identities of a pipeline (a pure function of it): ``gateway``,
``orchestrator``, ``worker-<s>-<r>`` and ``operator`` (read-only), each allowed exactly the
subjects and JetStream API calls its code uses (docs/security.md).

Each identity may subscribe only to its own inbox prefix (:func:`inbox_prefix`). The service roles
may create the pipeline's streams and buckets; only the orchestrator may update them.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.pipeline import Payload, PipelineConfig, StageType
from libs.common.subjects import (
    BUCKETS,
    EVICTIONS_BUCKET,
    JS_API,
    ORCHESTRATOR_ADMISSION_CONSUMER,
    ORCHESTRATOR_EVENTS_CONSUMER,
    REQUESTS_BUCKET,
    SERVICES_BUCKET,
    Subjects,
    consumer_name,
    kv_stream,
    kv_subject,
    max_deliveries_advisory,
)

GATEWAY = "gateway"
ORCHESTRATOR = "orchestrator"
OPERATOR = "operator"


def worker_identity(stage: int, replica: int) -> str:
    """The identity of worker (stage, replica): ``worker-<s>-<r>``."""
    return f"worker-{stage}-{replica}"


def inbox_prefix(identity: str) -> str:
    """The inbox prefix ``identity`` connects with and may subscribe below: ``_INBOX.<identity>``."""
    return f"_INBOX.{identity}"


@dataclass(frozen=True)
class Identity:
    """One NATS user: its name and what it may publish and subscribe to (allow lists)."""

    name: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.name)


def _declare(subjects: Subjects, update: bool) -> list[str]:
    """Creating (and with ``update`` updating) the streams and KV buckets, reading their info."""
    streams = [subjects.requests_stream, subjects.stages_stream, subjects.events_stream]
    streams += [kv_stream(b) for b in BUCKETS]
    calls = ["INFO", "CREATE", "UPDATE"] if update else ["INFO", "CREATE"]
    return [f"{JS_API}.STREAM.{call}.{s}" for s in streams for call in calls]


def _kv_read(bucket: str) -> list[str]:
    """Reading ``bucket``: a get (direct, or the stream's message get) and a watch."""
    s = kv_stream(bucket)
    return [
        f"{JS_API}.DIRECT.GET.{s}.>",
        f"{JS_API}.STREAM.MSG.GET.{s}",
        f"{JS_API}.CONSUMER.CREATE.{s}",
        f"{JS_API}.CONSUMER.CREATE.{s}.>",
        f"{JS_API}.CONSUMER.INFO.{s}.*",
        f"$JS.FC.{s}.>",
    ]


def _durable(stream: str, consumer: str) -> list[str]:
    """Creating durable pull consumer ``consumer`` of ``stream``, reading its info, pulling, acking."""
    return [
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
        f"{JS_API}.CONSUMER.INFO.{stream}.{consumer}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    ]


def _replicas(pipeline: PipelineConfig) -> list[tuple[int, int]]:
    return [(s, r) for s, stage in enumerate(pipeline.stages) for r in range(stage.replicas)]


def gateway(pipeline: PipelineConfig) -> Identity:
    p = Subjects(pipeline.name)
    publish = [
        p.requests,
        p.abort,
        kv_subject(SERVICES_BUCKET, f"{GATEWAY}.{pipeline.name}.*"),
        *_declare(p, update=False),
        *_kv_read(SERVICES_BUCKET),
    ]
    subscribe = [f"omni.{pipeline.name}.out.>", p.resume("*"), f"{inbox_prefix(GATEWAY)}.>"]
    return Identity(GATEWAY, tuple(publish), tuple(subscribe), allow_responses=True)


def orchestrator(pipeline: PipelineConfig) -> Identity:
    p = Subjects(pipeline.name)
    replicas = _replicas(pipeline)
    publish = [
        *(p.stage_in(s, r) for s, r in replicas),
        *(p.alive(s, r) for s, r in replicas),
        *(p.route(s, r) for s, r in replicas),
        p.orchestrator_alive("*"),
        p.abort,
        p.resume("*"),
        f"omni.{pipeline.name}.out.>",
        kv_subject(REQUESTS_BUCKET),
        kv_subject(EVICTIONS_BUCKET),
        kv_subject(SERVICES_BUCKET, f"{ORCHESTRATOR}.{pipeline.name}.*"),
        *_declare(p, update=True),
        *_durable(p.requests_stream, ORCHESTRATOR_ADMISSION_CONSUMER),
        *_durable(p.events_stream, ORCHESTRATOR_EVENTS_CONSUMER),
        f"{JS_API}.DIRECT.GET.{p.stages_stream}",
        f"{JS_API}.STREAM.MSG.GET.{p.stages_stream}",
        f"{JS_API}.STREAM.MSG.DELETE.{p.stages_stream}",
        *_kv_read(REQUESTS_BUCKET),
        *_kv_read(SERVICES_BUCKET),
        *_kv_read(EVICTIONS_BUCKET),
    ]
    subscribe = [p.orchestrator_alive("*"), f"{inbox_prefix(ORCHESTRATOR)}.>"]
    return Identity(ORCHESTRATOR, tuple(publish), tuple(subscribe), allow_responses=True)


def worker(pipeline: PipelineConfig, stage: int, replica: int) -> Identity:
    """Worker (stage, replica); a talker also writes request records."""
    p = Subjects(pipeline.name)
    me = pipeline.stages[stage]
    name = worker_identity(stage, replica)
    consumer = consumer_name(stage, replica)
    nxt = stage + 1
    feeds = nxt < len(pipeline.stages) and pipeline.upstream(nxt) == stage  # not the listener: it feeds none
    downstream = pipeline.stages[nxt].replicas if feeds else 0
    publish = [
        f"omni.{pipeline.name}.out.>",
        f"omni.{pipeline.name}.events.*",
        *(p.stage_in(nxt, r) for r in range(downstream)),
        kv_subject(SERVICES_BUCKET, f"worker.{pipeline.name}.{stage}.{replica}"),
        *_declare(p, update=False),
        *_durable(p.stages_stream, consumer),
        *_kv_read(REQUESTS_BUCKET),
    ]
    if me.type == StageType.LLM and me.emits == Payload.CODEC_CODES:
        publish.append(kv_subject(REQUESTS_BUCKET))
    subscribe = [
        p.abort,
        p.alive(stage, replica),
        p.route(stage, replica),
        max_deliveries_advisory(p.stages_stream, consumer),
        f"{inbox_prefix(name)}.>",
    ]
    return Identity(name, tuple(publish), tuple(subscribe), allow_responses=True)


def operator() -> Identity:
    """Read-only: stream, consumer and account info and lists, KV gets and key listings."""
    publish = [
        f"{JS_API}.INFO",
        f"{JS_API}.STREAM.NAMES",
        f"{JS_API}.STREAM.LIST",
        f"{JS_API}.STREAM.INFO.*",
        f"{JS_API}.CONSUMER.NAMES.*",
        f"{JS_API}.CONSUMER.LIST.*",
        f"{JS_API}.CONSUMER.INFO.*.*",
        *(call for b in BUCKETS for call in _kv_read(b)),
    ]
    return Identity(OPERATOR, tuple(publish), (f"{inbox_prefix(OPERATOR)}.>",), allow_responses=False)


def identities(pipeline: PipelineConfig) -> list[Identity]:
    """Every identity of ``pipeline``: gateway, orchestrator, one per worker, operator."""
    workers = [worker(pipeline, s, r) for s, r in _replicas(pipeline)]
    return [gateway(pipeline), orchestrator(pipeline), *workers, operator()]
