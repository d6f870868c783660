"""Connecting to NATS and declaring the JetStream streams, consumers and KV buckets of a pipeline.

Every declaration is idempotent, so any service may call :func:`ensure_topology` at start. A
client given several servers (comma-separated) moves between them, and the streams and buckets
it declares get one replica per server (:func:`replicas`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar
from urllib.parse import urlsplit
from weakref import WeakKeyDictionary

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    PersistMode,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from libs.common.consumer import Handler, PullConsumer
from libs.common.nats_credentials import NatsAuth, NatsCredentials
from libs.common.subjects import (
    EVICTIONS_BUCKET,
    JS_API,
    REQUESTS_BUCKET,
    SERVICES_BUCKET,
    Subjects,
    consumer_name,
    kv_stream,
    kv_subject,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BusLimits:
    """JetStream limits and redelivery settings (seconds, counts, bytes)."""

    requests_max_msgs: int = 10_000
    """Admission queue bound (a full queue: HTTP 429)."""
    stages_max_bytes: int = 1 << 30
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    max_ack_pending: int = 1024
    duplicate_window_s: float = 120.0
    service_ttl_s: float = 6.0
    """``omni_services`` entries vanish this long after the last heartbeat."""
    heartbeat_s: float = 2.0
    request_record_ttl_s: float = 3600.0
    """``omni_requests`` and ``omni_evictions`` entries vanish this long after their last update."""

    @property
    def backoff_s(self) -> tuple[float, ...]:
        """Delay before redelivery n = 1, 2, ...: 1, 1, 2, 4 × ``ack_wait_s``."""
        return tuple(self.ack_wait_s * k for k in (1, 1, 2, 4))[: self.max_deliver - 1]


LIMITS = BusLimits()
ORCHESTRATOR_ACK_WAIT_S = 1.0
"""Redelivery timer of the orchestrators' consumers, seconds: the delay an orchestrator's death adds."""
ORCHESTRATOR_MAX_DELIVER = 30
RECONNECT_WAIT_S = 0.25
"""Pause between a client's attempts to reach a server again, seconds."""
DRAIN_TIMEOUT_S = 5.0
"""How long a shutting-down service waits for its subscriptions to drain, seconds."""
MAX_REPLICAS = 5
"""JetStream keeps at most this many replicas of a stream."""

_replicas: WeakKeyDictionary[NATS, int] = WeakKeyDictionary()
"""Replicas of what each client made by :func:`connect` declares."""


def server_urls(url: str) -> list[str]:
    """The server URLs in comma-separated ``url``; ValueError when there is none."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


def replicas_for(servers: list[str]) -> int:
    """Replicas of streams and buckets: one per distinct server, at most :data:`MAX_REPLICAS`."""
    return min(len(set(servers)), MAX_REPLICAS)


def direct_reads(n_replicas: int) -> bool:
    """Direct gets only with one replica: a follower's answer can lag an acknowledged write."""
    return n_replicas == 1


def replicas(js: JetStreamContext) -> int:
    """Replicas of what is declared through ``js`` (1 for a client not made by :func:`connect`)."""
    return _replicas.get(js._nc, 1)  # nats-py keeps the client of a context only there


def redact(url: str) -> str:
    """``url`` as it may be logged: a user or password in it replaced by ``***``."""
    out = []
    for server in server_urls(url):
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        out.append(
            server
            if parts.username is None and parts.password is None
            else server.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1])
        )
    return ",".join(out)


async def connect(
    url: str, name: str, credentials: NatsAuth | None = None, on_reconnect: Callable[[], None] | None = None
) -> NATS:
    """Connect to one of the servers in ``url`` (comma-separated), reconnecting without limit, as
    ``credentials`` (default: the environment's); ``on_reconnect()`` runs on every reconnect."""
    servers = server_urls(url)
    shown = redact(url)
    options = (credentials if credentials is not None else NatsCredentials()).connect_options()
    nc = NATS()

    async def _disconnected() -> None:
        if not nc.is_closed:  # nats-py reports a deliberate close as a disconnect too
            log.warning("NATS disconnected (%s); reconnecting", shown)

    async def _reconnected() -> None:
        log.info("NATS reconnected (%s)", shown)
        if on_reconnect is not None:
            on_reconnect()

    async def _error(e: Exception) -> None:
        log.warning("NATS error: %s", e)

    await nc.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        connect_timeout=5,
        drain_timeout=DRAIN_TIMEOUT_S,
        disconnected_cb=_disconnected,
        reconnected_cb=_reconnected,
        error_cb=_error,
        **options,
    )
    _replicas[nc] = replicas_for(servers)
    return nc


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create the stream ``cfg`` describes, or update the one that exists to it.

    JetStream fixes a stream's persist mode at creation (``async`` only on a single replica): a
    stream whose mode must change is made anew when it holds no message or consumer and this
    identity may delete it; otherwise it keeps its mode and replicas, and the log says so."""
    try:
        await js.add_stream(cfg)
        return
    except BadRequestError as e:
        if e.err_code != STREAM_NAME_IN_USE:
            raise
    info = await js.stream_info(cfg.name)
    if _persist_mode(info.config) == _persist_mode(cfg):
        await js.update_stream(cfg)
        return
    if info.state.messages == 0 and info.state.consumer_count == 0:
        try:
            await js.delete_stream(cfg.name)
        except Exception as e:  # not this identity's to delete (docs/security.md): kept below
            log.info("stream %s not made anew in persist mode %s: %s", cfg.name, _persist_mode(cfg).value, e)
        else:
            log.info("stream %s: made anew in persist mode %s", cfg.name, _persist_mode(cfg).value)
            await js.add_stream(cfg)
            return
    log.warning(
        "stream %s keeps persist mode %s and %d replica(s) (%d messages, %d consumers)",
        cfg.name,
        _persist_mode(info.config).value,
        info.config.num_replicas,
        info.state.messages,
        info.state.consumer_count,
    )
    kept = replace(cfg, persist_mode=info.config.persist_mode, num_replicas=info.config.num_replicas)
    try:  # the stream as it is: taken as declared, by an identity that may only create streams
        await js.add_stream(kept)
    except BadRequestError:
        await js.update_stream(kept)


def _persist_mode(cfg: StreamConfig) -> PersistMode:
    return PersistMode(cfg.persist_mode) if cfg.persist_mode else PersistMode.DEFAULT


T = TypeVar("T")

TOPOLOGY_TRIES = 3
"""Tries of a topology declaration or bucket look-up that JetStream does not answer in time."""
STREAM_NAME_IN_USE = 10058
"""JetStream's error code for a stream created under a name in use with another configuration."""
NO_PEERS_FOR_PLACEMENT = 10005
"""JetStream's error code for a replicated stream no set of servers can hold yet: a cluster whose
metadata leader, just elected, does not know its peers yet answers so for a moment."""
PLACEMENT_WAIT_S, PLACEMENT_RETRY_S = 15.0, 0.25
"""How long a declaration waits out :data:`NO_PEERS_FOR_PLACEMENT`, and how often it asks again,
seconds."""


async def ensure_topology(js: JetStreamContext, subjects: Subjects, limits: BusLimits = LIMITS) -> None:
    """Declare the pipeline's streams and KV buckets, each scaled to :func:`replicas` replicas."""
    await _asked_again("a topology declaration", lambda: _declare_topology(js, subjects, limits))


async def _asked_again(what: str, ask: Callable[[], Awaitable[T]]) -> T:
    """``ask()``, made again on a JetStream timeout (``TOPOLOGY_TRIES`` in all), and every
    :data:`PLACEMENT_RETRY_S` while a forming cluster cannot place a stream yet (for up to
    :data:`PLACEMENT_WAIT_S`)."""
    tries_left, placement_deadline = TOPOLOGY_TRIES - 1, time.monotonic() + PLACEMENT_WAIT_S
    while True:
        try:
            return await ask()
        except NatsTimeoutError:
            if tries_left == 0:
                raise
            log.warning("JetStream did not answer %s in time (%d more tries)", what, tries_left)
            tries_left -= 1
        except APIError as e:
            if e.err_code != NO_PEERS_FOR_PLACEMENT or time.monotonic() > placement_deadline:
                raise
            log.info("JetStream cannot place %s yet (%s): asking again", what, e.description)
            await asyncio.sleep(PLACEMENT_RETRY_S)


async def _declare_topology(js: JetStreamContext, subjects: Subjects, limits: BusLimits) -> None:
    n = replicas(js)
    work_queue = dict(
        num_replicas=n,
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        duplicate_window=limits.duplicate_window_s,
    )
    for cfg in (
        StreamConfig(
            name=subjects.requests_stream,
            subjects=[subjects.requests],
            max_msgs=limits.requests_max_msgs,
            persist_mode=PersistMode.ASYNC if n == 1 else None,
            **work_queue,
        ),
        StreamConfig(
            name=subjects.stages_stream,
            subjects=[subjects.stages_wildcard],
            max_bytes=limits.stages_max_bytes,
            **work_queue,
        ),
        StreamConfig(name=subjects.events_stream, subjects=[subjects.events_wildcard], **work_queue),
    ):
        await _ensure_stream(js, cfg)
    for bucket, ttl_s in (
        (SERVICES_BUCKET, limits.service_ttl_s),
        (REQUESTS_BUCKET, limits.request_record_ttl_s),
        (EVICTIONS_BUCKET, limits.request_record_ttl_s),
    ):
        await _ensure_kv_replicas(js, bucket, ttl_s)


async def _ensure_kv_replicas(js: JetStreamContext, bucket: str, ttl_s: float) -> None:
    """Create ``bucket``, or scale its stream to :func:`replicas`."""
    try:
        info = await js.stream_info(kv_stream(bucket))
    except NotFoundError:
        await _kv(js, bucket, ttl_s)
        return
    n = replicas(js)
    if info.config.num_replicas != n or bool(info.config.allow_direct) != direct_reads(n):
        log.info("KV bucket %s: %s -> %s replicas", bucket, info.config.num_replicas, n)
        await js.update_stream(replace(info.config, num_replicas=n, allow_direct=direct_reads(n)))


async def _kv(js: JetStreamContext, bucket: str, ttl_s: float) -> KeyValue:
    """``bucket``, created with :func:`replicas` replicas only when JetStream says it has none
    (each asked again as :func:`_asked_again` says)."""
    try:
        return await _asked_again(f"the look-up of bucket {bucket}", lambda: js.key_value(bucket))
    except NotFoundError:  # nats-py's BucketNotFoundError is one
        pass
    n = replicas(js)
    config = KeyValueConfig(
        bucket=bucket, history=1, ttl=ttl_s, storage=StorageType.FILE, replicas=n, direct=direct_reads(n)
    )
    # Asked again on a timeout: a cluster just formed, busy with other declarations, has taken
    # longer than a request's timeout to create a replicated bucket (creating it again is a no-op).
    return await _asked_again(f"the creation of bucket {bucket}", lambda: js.create_key_value(config))


async def services_kv(js: JetStreamContext, limits: BusLimits = LIMITS) -> KeyValue:
    return await _kv(js, SERVICES_BUCKET, limits.service_ttl_s)


async def requests_kv(js: JetStreamContext, limits: BusLimits = LIMITS) -> KeyValue:
    return await _kv(js, REQUESTS_BUCKET, limits.request_record_ttl_s)


async def evictions_kv(js: JetStreamContext, limits: BusLimits = LIMITS) -> KeyValue:
    return await _kv(js, EVICTIONS_BUCKET, limits.request_record_ttl_s)


def stage_consumer_config(
    subjects: Subjects, stage: int, replica: int, limits: BusLimits = LIMITS
) -> ConsumerConfig:
    """Durable pull consumer ``stage-<s>-<r>`` of worker (stage, replica)."""
    return ConsumerConfig(
        durable_name=consumer_name(stage, replica),
        filter_subject=subjects.stage_in(stage, replica),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=limits.ack_wait_s,
        max_deliver=limits.max_deliver,
        backoff=list(limits.backoff_s),
        max_ack_pending=limits.max_ack_pending,
    )


def orchestrator_consumer_config(subject: str, durable: str, limits: BusLimits = LIMITS) -> ConsumerConfig:
    """Shared durable pull consumer of the orchestrator instances."""
    return ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ORCHESTRATOR_ACK_WAIT_S,
        max_deliver=ORCHESTRATOR_MAX_DELIVER,
        max_ack_pending=limits.max_ack_pending,
    )


async def consume(
    nc: NATS,
    js: JetStreamContext,
    stream: str,
    config: ConsumerConfig,
    handle: Handler,
    *,
    batch: int,
    name: str,
) -> PullConsumer:
    """Declare (or update) durable pull consumer ``config`` on ``stream``; hand its messages to ``handle``."""
    try:
        await js.add_consumer(stream, config)
    except BadRequestError as e:  # a change the server does not allow on an existing consumer
        log.warning("consumer %s of %s kept as it is: %s", config.durable_name, stream, e.description)
    consumer = PullConsumer(nc, stream, config.durable_name, handle, batch=batch, name=name)
    await consumer.start()
    return consumer


async def bucket_keys(nc: NATS, bucket: str, timeout_s: float = 5.0) -> set[str]:
    """Every key ``bucket`` holds a message for (a value, or a delete or purge marker), from the
    subjects its stream's leader counts, a page of up to 100,000 at a time (``timeout_s`` per
    page). ``KeyValue.keys()`` can stop early while keys are written (nats-io/nats.py#995).
    Raises :class:`NotFoundError` (no such bucket) or :class:`ServiceUnavailableError`."""
    prefix = kv_subject(bucket, "")
    asked = {"subjects_filter": kv_subject(bucket)}
    keys: set[str] = set()
    offset = 0
    while True:
        try:
            msg = await nc.request(
                f"{JS_API}.STREAM.INFO.{kv_stream(bucket)}",
                json.dumps(asked | {"offset": offset}).encode(),
                timeout=timeout_s,
            )
        except NoRespondersError:
            raise ServiceUnavailableError from None
        answer = json.loads(msg.data)
        if "error" in answer:
            APIError.from_error(answer["error"])
        page = answer["state"].get("subjects") or {}
        keys.update(subject.removeprefix(prefix) for subject in page)
        offset += len(page)
        if not page or offset >= answer.get("total", 0):
            return keys
