"""Sending on the bus with the contract's headers.

``Omni-Tx-Start-Ns`` is read before the envelope is serialized and ``Omni-Tx-End-Ns`` when the
serialized bytes are handed to the NATS client, both on the sender's wall clock (ns). A header
cannot carry the time of its own publish acknowledgement, so the acknowledgement round trip is
part of what the receiver sees as in-flight time, never of tx.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry.trace import Span

from libs.common import headers as h
from libs.common.envelopes import ClientEvent, LifecycleEvent, StageTask
from libs.common.subjects import Subjects
from libs.common.tracing import inject_headers

PUBLISH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Hop:
    """Sender and receiver of one transfer; the sender is ``orchestrator`` for stage 0."""

    from_stage: str
    from_replica: str
    to_stage: int
    to_replica: int


def task_msg_id(task: StageTask, to_stage: int) -> str:
    """``Nats-Msg-Id`` of a task: ``<request>.<to_stage>.<seq>``, plus ``.<attempt>`` for the
    receiving stage's attempts after the first (a moved request's input is new to the stream,
    while a chunk its upstream sends again is the duplicate the stream drops), plus ``.f<attempt>``
    for the sending stage's attempts after the first (a chunk a stale sender got in first must not
    make the stream drop its successor's chunk of the same number; the receiver's inbox drops a
    number it has had)."""
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
    """Publish ``task`` to worker (to_stage, to_replica) and wait for JetStream's ack (whose
    ``duplicate`` flag tells a re-send that ``Nats-Msg-Id`` de-duplication dropped). ``span``'s
    context travels in ``traceparent``/``tracestate`` when tracing is on."""
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


async def publish_client(nc: NATS, subjects: Subjects, gateway_id: str, event: ClientEvent) -> bytes:
    """Send a client-visible event of one request to its gateway (core NATS, fire and forget).

    No headers: the subject names the gateway and the request, and the body says the rest. A
    request streams one of these per token, and headers cost both ends (nats-py builds and parses
    them in Python): without them the worker and the gateway spend ~12 % less CPU per request at
    concurrency 16. Returns the body sent (the worker keeps it for a replay)."""
    data = event.encode()
    await nc.publish(subjects.out(gateway_id, event.request_id), data)
    return data


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
