"""Connecting to NATS and declaring the JetStream streams, consumers and KV buckets of a pipeline.

Every declaration is idempotent (create, or update to the declared config), so any service may
call :func:`ensure_topology` at start; the last writer wins with the same config.

A client may be given several servers (every server of a JetStream cluster, comma-separated as
``NATS_URL`` conventionally is): it connects to one of them and moves to another when that one
goes, and the streams and KV buckets it declares get one replica per server it was given
(:func:`replicas`), so that they survive the loss of any one server.
"""

from __future__ import annotations

import json
import logging
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
    """Admission queue bound; a full queue rejects new requests (HTTP 429)."""
    stages_max_bytes: int = 1 << 30
    ack_wait_s: float = 30.0
    """Redelivery timer; workers send in-progress acks every ``ack_wait_s / 6`` while busy."""
    max_deliver: int = 5
    max_ack_pending: int = 1024
    duplicate_window_s: float = 120.0
    """``Nats-Msg-Id`` de-duplication window."""
    service_ttl_s: float = 6.0
    """``omni_services`` entries vanish this long after the last heartbeat."""
    heartbeat_s: float = 2.0
    request_record_ttl_s: float = 3600.0
    """``omni_requests`` records vanish this long after their last update."""

    @property
    def backoff_s(self) -> tuple[float, ...]:
        """Delay before redelivery n = 1, 2, ...: 1, 1, 2, 4 × ``ack_wait_s`` (NATS uses the first
        entry in place of ``ack_wait``)."""
        return tuple(self.ack_wait_s * k for k in (1, 1, 2, 4))[: self.max_deliver - 1]


LIMITS = BusLimits()
ORCHESTRATOR_ACK_WAIT_S = 1.0
"""Redelivery timer of the orchestrators' consumers (admissions, lifecycle events), seconds. An
orchestrator works on one of these messages for milliseconds and sends in-progress acks while it
works longer, so a message is redelivered to another instance about this long after the one
holding it died or stopped: the delay an orchestrator's death adds to a request."""
ORCHESTRATOR_MAX_DELIVER = 30
"""Deliveries of an orchestrator's message before JetStream gives up on it (a message whose
handling keeps failing; an admission is answered 504 once its deadline has passed anyway)."""
RECONNECT_WAIT_S = 0.25
"""How long a client waits between attempts to reach a server again, seconds: a broker that comes
back is used within this much (an attempt against a server that is down is a refused connection)."""
DRAIN_TIMEOUT_S = 5.0
"""How long a shutting-down service waits for its subscriptions to drain, seconds."""
MAX_REPLICAS = 5
"""JetStream keeps at most this many replicas of a stream."""

_replicas: WeakKeyDictionary[NATS, int] = WeakKeyDictionary()
"""Replicas of what each client made by :func:`connect` declares (one per server it was given)."""


def server_urls(url: str) -> list[str]:
    """The server URLs in ``url``: one, or several separated by commas (blanks around them dropped);
    ValueError when there is none."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    return servers


def replicas_for(servers: list[str]) -> int:
    """Replicas of streams and buckets for a client given ``servers``: one per distinct server,
    at most :data:`MAX_REPLICAS` (1 for a single server)."""
    return min(len(set(servers)), MAX_REPLICAS)


def direct_reads(n_replicas: int) -> bool:
    """Whether a bucket of ``n_replicas`` answers reads by direct get (``allow_direct``): a plain
    request its stream answers with the stored message, instead of a JetStream API call whose
    reply is JSON with the message in base64. Only with one replica: with more, every replica
    answers direct gets, and a follower's answer can lag a write its leader has acknowledged, so
    a record read could miss the route an orchestrator just wrote."""
    return n_replicas == 1


def replicas(js: JetStreamContext) -> int:
    """Replicas of the streams and buckets declared through ``js``: :func:`replicas_for` the servers
    its client was given by :func:`connect`; 1 for a client made otherwise (a tool, a test)."""
    return _replicas.get(js._nc, 1)  # nats-py keeps the client of a context only there


def redact(url: str) -> str:
    """``url`` (one or several servers) as it may be logged: a user or password in it replaced by
    ``***``."""
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
    """Connect to one of the servers in ``url`` (comma-separated: every server of a cluster), with
    unlimited reconnects to any of them (services survive a broker restart or a node's loss).

    As the identity of ``credentials``, by default the one the environment names
    (``OMNIRELAY_NATS_USER`` ..., :class:`libs.common.nats_credentials.NatsCredentials`; none: an
    anonymous client, for a server without authorization), with its own inbox prefix, over TLS
    verified against ``OMNIRELAY_NATS_CA`` when it is set. ``on_reconnect`` is called (on the
    event loop, not awaited: start a task for any work) each time the client is connected again."""
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

    JetStream fixes a stream's persist mode when it creates it, and takes ``async`` only on a
    single replica (ADR-56): a stream whose mode must change (the requests stream of one server,
    ``async``, given a cluster's replicas, or a stream made before in the default mode) is made
    anew when nothing uses it (no message, no consumer) and this identity may delete it; otherwise
    it keeps its mode and its replicas, and the log says so."""
    try:
        await js.add_stream(cfg)
        return
    except BadRequestError:
        pass
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
    """``cfg``'s persist mode (JetStream leaves the default unset)."""
    return PersistMode(cfg.persist_mode) if cfg.persist_mode else PersistMode.DEFAULT


T = TypeVar("T")

TOPOLOGY_TRIES = 3
"""Declaring the topology, or looking a KV bucket up (:func:`_kv`), is tried this often when
JetStream does not answer in time (a cluster creating replicated streams elects a leader for
each, which can outlast one API timeout)."""


async def ensure_topology(js: JetStreamContext, subjects: Subjects, limits: BusLimits = LIMITS) -> None:
    """Declare the pipeline's streams and KV buckets, each with :func:`replicas` replicas (an
    existing stream or bucket with another number is scaled to it). Every declaration is
    idempotent, so a declaration that timed out is simply made again (``TOPOLOGY_TRIES``)."""
    await _asked_again("a topology declaration", lambda: _declare_topology(js, subjects, limits))


async def _asked_again(what: str, ask: Callable[[], Awaitable[T]]) -> T:
    """``ask()``, made again when JetStream does not answer it in time (``TOPOLOGY_TRIES`` in all;
    the last timeout is raised). ``what`` names it in the log."""
    for tries_left in range(TOPOLOGY_TRIES - 1, 0, -1):
        try:
            return await ask()
        except NatsTimeoutError:
            log.warning("JetStream did not answer %s in time (%d more tries)", what, tries_left)
    return await ask()


async def _declare_topology(js: JetStreamContext, subjects: Subjects, limits: BusLimits) -> None:
    work_queue = dict(
        num_replicas=replicas(js),
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        duplicate_window=limits.duplicate_window_s,
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.requests_stream,
            subjects=[subjects.requests],
            max_msgs=limits.requests_max_msgs,
            persist_mode=PersistMode.ASYNC if work_queue["num_replicas"] == 1 else None,
            **work_queue,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.stages_stream,
            subjects=[subjects.stages_wildcard],
            max_bytes=limits.stages_max_bytes,
            **work_queue,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(name=subjects.events_stream, subjects=[subjects.events_wildcard], **work_queue),
    )
    for bucket, ttl_s in (
        (SERVICES_BUCKET, limits.service_ttl_s),
        (REQUESTS_BUCKET, limits.request_record_ttl_s),
        (EVICTIONS_BUCKET, limits.request_record_ttl_s),
    ):
        await _ensure_kv_replicas(js, bucket, ttl_s)


async def _ensure_kv_replicas(js: JetStreamContext, bucket: str, ttl_s: float) -> None:
    """Create ``bucket``, or scale the stream behind it (``KV_<bucket>``) to :func:`replicas`."""
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
    """``bucket``, created with :func:`replicas` replicas when missing (an existing one is taken as
    it is: only :func:`ensure_topology` scales). Only a bucket JetStream says it does not have is
    created: a look-up that timed out is made again (``TOPOLOGY_TRIES`` in all), and one that met
    a stream without a leader raises. Creating then would meet an existing bucket, perhaps with
    more replicas than this client's servers count, and fail with "stream name already in use"."""
    try:
        return await _asked_again(f"the look-up of bucket {bucket}", lambda: js.key_value(bucket))
    except NotFoundError:  # nats-py's BucketNotFoundError is one
        pass
    n = replicas(js)
    return await js.create_key_value(
        KeyValueConfig(
            bucket=bucket,
            history=1,
            ttl=ttl_s,
            storage=StorageType.FILE,
            replicas=n,
            direct=direct_reads(n),
        )
    )


async def services_kv(js: JetStreamContext, limits: BusLimits = LIMITS) -> KeyValue:
    """The ``omni_services`` bucket (entries expire ``service_ttl_s`` after the last write)."""
    return await _kv(js, SERVICES_BUCKET, limits.service_ttl_s)


async def requests_kv(js: JetStreamContext, limits: BusLimits = LIMITS) -> KeyValue:
    """The ``omni_requests`` bucket."""
    return await _kv(js, REQUESTS_BUCKET, limits.request_record_ttl_s)


async def evictions_kv(js: JetStreamContext, limits: BusLimits = LIMITS) -> KeyValue:
    """The ``omni_evictions`` bucket (entries kept as long as request records)."""
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
    """Shared durable pull consumer of the orchestrator instances: a message an instance holds is
    redelivered :data:`ORCHESTRATOR_ACK_WAIT_S` after it stopped working on it."""
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
    """Declare durable pull consumer ``config`` on ``stream`` (one that exists is updated to it:
    a deployment that changes its redelivery settings gets them) and hand its messages to
    ``handle`` as they arrive, at most ``batch`` asked for at a time."""
    try:
        await js.add_consumer(stream, config)
    except BadRequestError as e:  # a change the server does not allow on an existing consumer
        log.warning("consumer %s of %s kept as it is: %s", config.durable_name, stream, e.description)
    consumer = PullConsumer(nc, stream, config.durable_name, handle, batch=batch, name=name)
    await consumer.start()
    return consumer


async def bucket_keys(nc: NATS, bucket: str, timeout_s: float = 5.0) -> set[str]:
    """Every key ``bucket`` holds a message for: a value, or the marker a delete or purge left
    (a get of such a key says it is gone). Read from the subjects the stream's leader counts, in
    one answer per page of up to 100,000 keys; ``timeout_s`` bounds each answer, seconds.

    ``KeyValue.keys()`` is not used: it stops at the first delivery that reports nothing pending,
    and while keys are written (every service's heartbeat) that can come before the last key
    (nats-io/nats.py#995). Raises :class:`NotFoundError` when there is no such bucket, and
    :class:`ServiceUnavailableError` when no server answers for it. A key written between two
    pages may be missed or repeated; one page always holds a bucket of fewer keys whole."""
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
