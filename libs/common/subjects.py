"""NATS subjects, JetStream stream/consumer names and KV bucket names — the only place they are spelled.

Subjects go from general to specific: ``omni.<pipeline>.<kind>...``. Stage and replica are ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SERVICES_BUCKET = "omni_services"
"""KV bucket: one key per live service instance, kept alive by heartbeats."""
REQUESTS_BUCKET = "omni_requests"
"""KV bucket: one key per request (in flight, then kept until the bucket's max age)."""
EVICTIONS_BUCKET = "omni_evictions"
"""KV bucket: one key per replica incarnation declared dead (:meth:`Subjects.eviction_key`),
created once, so exactly one orchestrator counts the eviction."""
BUCKETS = (SERVICES_BUCKET, REQUESTS_BUCKET, EVICTIONS_BUCKET)
JS_API = "$JS.API"


def kv_stream(bucket: str) -> str:
    """The JetStream stream that holds KV ``bucket``."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str = ">") -> str:
    """The subject ``key`` of KV ``bucket`` is stored under (by default, every key's)."""
    return f"$KV.{bucket}.{key}"


ORCHESTRATOR_ADMISSION_CONSUMER = "orchestrator"
ORCHESTRATOR_EVENTS_CONSUMER = "orchestrator-events"
"""Durable pull consumers on the requests and events streams, shared by the orchestrators."""

EVENT_KINDS = ("started", "stage_done", "finished", "failed", "aborted")
"""Lifecycle event kinds published on ``omni.<pipeline>.events.<kind>``."""

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """Return ``value`` if it is usable as one subject token (no dots, spaces or wildcards)."""
    if not _TOKEN_RE.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-]+)")
    return value


def max_deliveries_advisory(stream: str, consumer: str) -> str:
    """JetStream's advisory subject, published when a message of ``consumer`` hits max_deliver."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


BATCH_TOKEN = "~"
"""The last token of :meth:`Subjects.out_batch`: outside a request id's alphabet."""


def consumer_name(stage: int, replica: int) -> str:
    """Durable consumer of worker (stage, replica): ``stage-<s>-<r>``."""
    return f"stage-{stage}-{replica}"


@dataclass(frozen=True)
class Subjects:
    """Subject and stream names of one pipeline."""

    pipeline: str

    def __post_init__(self) -> None:
        check_token(self.pipeline, "pipeline name")

    @property
    def _suffix(self) -> str:
        return re.sub(r"[^A-Z0-9_]", "_", self.pipeline.upper())

    # --- subjects -------------------------------------------------------------------------
    @property
    def requests(self) -> str:
        """Admission envelopes, gateway → orchestrator (JetStream, work queue)."""
        return f"omni.{self.pipeline}.requests"

    def stage_in(self, stage: int, replica: int) -> str:
        """Task/chunk envelopes for worker (stage, replica) (JetStream, work queue)."""
        return f"omni.{self.pipeline}.stage.{stage}.{replica}.in"

    @property
    def stages_wildcard(self) -> str:
        return f"omni.{self.pipeline}.stage.>"

    def out(self, gateway_id: str, request_id: str) -> str:
        """Client events of one request (core NATS); also the worker's ``ResumeQuery``."""
        return f"omni.{self.pipeline}.out.{gateway_id}.{request_id}"

    def out_batch(self, gateway_id: str) -> str:
        """Client events of several requests of one gateway in one message (core NATS)."""
        return f"omni.{self.pipeline}.out.{gateway_id}.{BATCH_TOKEN}"

    def out_wildcard(self, gateway_id: str) -> str:
        return f"omni.{self.pipeline}.out.{gateway_id}.*"

    def event(self, kind: str) -> str:
        """Lifecycle events, all → orchestrator (JetStream, work queue)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        return f"omni.{self.pipeline}.events.{kind}"

    @property
    def events_wildcard(self) -> str:
        return f"omni.{self.pipeline}.events.>"

    @property
    def abort(self) -> str:
        """Abort broadcast: cancel a request in every worker (core NATS)."""
        return f"omni.{self.pipeline}.ctl.abort"

    def alive(self, stage: int, replica: int) -> str:
        """Liveness probe of worker (stage, replica) (core NATS request/reply)."""
        return f"omni.{self.pipeline}.ctl.alive.{stage}.{replica}"

    def orchestrator_alive(self, instance: str) -> str:
        """Liveness probe of orchestrator ``instance`` (core NATS request/reply, empty body and answer)."""
        return f"omni.{self.pipeline}.ctl.alive.orchestrator.{instance}"

    def resume(self, gateway_id: str) -> str:
        """A move's ``ResumeQuery`` to gateway ``gateway_id`` (core NATS request/reply)."""
        return f"omni.{self.pipeline}.ctl.resume.{gateway_id}"

    def route(self, stage: int, replica: int) -> str:
        """A move's route notices to the worker upstream (core NATS request/reply)."""
        return f"omni.{self.pipeline}.ctl.route.{stage}.{replica}"

    def eviction_key(self, stage: int, replica: int, started_ns: int) -> str:
        """Key in ``omni_evictions`` of one incarnation of worker (stage, replica)."""
        return f"{self.pipeline}.{stage}.{replica}.{started_ns}"

    # --- JetStream streams ----------------------------------------------------------------
    @property
    def requests_stream(self) -> str:
        return f"OMNI_{self._suffix}_REQUESTS"

    @property
    def stages_stream(self) -> str:
        return f"OMNI_{self._suffix}_STAGES"

    @property
    def events_stream(self) -> str:
        return f"OMNI_{self._suffix}_EVENTS"
