"""Sending on the bus with the contract's headers.

``Omni-Tx-Start-Ns`` is read before the envelope is serialized and ``Omni-Tx-End-Ns`` when the
bytes are handed to the NATS client (sender's wall clock, ns); the publish acknowledgement is
part of the receiver's in-flight time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.errors import ConnectionReconnectingError, NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from opentelemetry.trace import Span

from libs.common import headers as h
from libs.common.envelopes import ClientEvent, LifecycleEvent, StageTask
from libs.common.subjects import Subjects
from libs.common.tracing import inject_headers

log = logging.getLogger(__name__)
T = TypeVar("T")

PUBLISH_TIMEOUT_S = 5.0
RECONNECT_POLL_S = 0.05
"""How often a publish waiting for the connection looks again, seconds."""
STORE_RETRY_S = 0.25
STORE_RETRY_MAX_S = 2.0
"""An unacknowledged stream publish is sent again after this, doubling up to the max, seconds."""
NOT_NOW = (
    OutboundBufferLimitError,
    ConnectionReconnectingError,
    NatsTimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
"""What a publish raises while the broker is away: the message may go out later."""


async def until_connected(nc: NATS) -> None:
    """Return once ``nc`` is connected (or closed), instead of filling nats-py's reconnect buffer."""
    while not nc.is_connected:
        if nc.is_closed:
            return  # the publish that follows raises ConnectionClosedError
        await asyncio.sleep(RECONNECT_POLL_S)


async def publish_core(nc: NATS, subject: str, data: bytes) -> None:
    """Core NATS publish that waits out a lost connection; returns once nats-py has taken it."""
    while True:
        if not nc.is_connected:  # no coroutine per message while connected
            await until_connected(nc)
        try:
            await nc.publish(subject, data)
            return
        except (OutboundBufferLimitError, ConnectionReconnectingError):
            continue  # the connection dropped between the check and the publish


@dataclass(frozen=True)
class Hop:
    """Sender and receiver of one transfer; the sender is ``orchestrator`` for stage 0."""

    from_stage: str
    from_replica: str
    to_stage: int
    to_replica: int


def task_msg_id(task: StageTask, to_stage: int) -> str:
    """``Nats-Msg-Id`` of a task: ``<request>.<to_stage>.<seq>``, plus ``.<attempt>`` for the
    receiving stage's attempts after the first, plus ``.f<attempt>`` for the sending stage's."""
    base = f"{task.request_id}.{to_stage}.{task.seq}"
    if task.attempt > 1:
        base = f"{base}.{task.attempt}"
    return base if task.from_attempt == 1 else f"{base}.f{task.from_attempt}"


async def publish_task(
    js: JetStreamContext,
    subjects: Subjects,
    task: StageTask,
    hop: Hop,
    span: Span | None = None,
) -> PubAck:
    """Publish ``task`` to worker (to_stage, to_replica) and wait for JetStream's ack."""
    tx_start = time.time_ns()
    body = task.encode()
    hdrs = {
        h.REQUEST_ID: task.request_id,
        h.ARRIVAL_NS: str(task.arrival_ns),
        h.FROM_STAGE: hop.from_stage,
        h.FROM_REPLICA: hop.from_replica,
        h.TO_STAGE: str(hop.to_stage),
        h.TO_REPLICA: str(hop.to_replica),
        h.SEQ: str(task.seq),
        h.FINAL: "true" if task.final else "false",
        h.PAYLOAD_BYTES: str(len(body)),
        h.MSG_ID: task_msg_id(task, hop.to_stage),
    }
    inject_headers(hdrs, span)
    hdrs[h.TX_START_NS] = str(tx_start)
    hdrs[h.TX_END_NS] = str(time.time_ns())
    return await js.publish(
        subjects.stage_in(hop.to_stage, hop.to_replica),
        body,
        headers=hdrs,
        timeout=PUBLISH_TIMEOUT_S,
    )


async def publish_client(nc: NATS, subjects: Subjects, gateway_id: str, event: ClientEvent) -> None:
    """Send a client-visible event of one request to its gateway (core NATS, no headers)."""
    await publish_core(nc, subjects.out(gateway_id, event.request_id), event.encode())


async def until_stored(
    nc: NATS, send: Callable[[], Awaitable[T]], what: str, expired: Callable[[], bool] | None = None
) -> T:
    """``send()`` (a stream publish), again while the broker is away (:data:`NOT_NOW`), once the
    connection is back, after ``STORE_RETRY_S`` doubling to ``STORE_RETRY_MAX_S``. ``expired()``
    (checked after a failure) ends the tries by raising the last error."""
    pause_s = STORE_RETRY_S
    while True:
        await until_connected(nc)
        try:
            return await send()
        except NOT_NOW as e:
            if expired is not None and expired():
                raise
            log.info("%s not stored yet (%s); again in %.2f s", what, type(e).__name__, pause_s)
        await asyncio.sleep(pause_s)
        pause_s = min(2 * pause_s, STORE_RETRY_MAX_S)


async def publish_lifecycle(js: JetStreamContext, subjects: Subjects, event: LifecycleEvent) -> None:
    """Record a lifecycle event for the orchestrator (JetStream, de-duplicated per request/kind/stage)."""
    await js.publish(
        subjects.event(event.kind),
        event.encode(),
        headers={
            h.REQUEST_ID: event.request_id,
            h.MSG_ID: f"{event.request_id}.{event.kind}.{event.stage}"
            + (f".{event.attempt}" if event.attempt > 1 else ""),
        },
        timeout=PUBLISH_TIMEOUT_S,
    )
