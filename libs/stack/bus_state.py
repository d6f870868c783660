"""What the bus holds about a pipeline, read as plain data: streams, per-(stage, replica)
consumer state, live services (``omni_services``) and request records (``omni_requests``).
``omnirelay inspect`` renders it; benchmarks and tests read it. :func:`barrier` is their way to
know the server has what a connection sent."""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from libs.common.bus import bucket_keys, connect, requests_kv, services_kv
from libs.common.nats_credentials import NatsAuth
from libs.common.pipeline import PipelineConfig
from libs.common.records import RequestRecord
from libs.common.registry import ServiceRecord
from libs.common.subjects import REQUESTS_BUCKET, SERVICES_BUCKET, Subjects, consumer_name


async def barrier(nc: NATS) -> None:
    """Return once the server has processed every command ``nc`` sent before the call (a SUB, a
    PUB, an ack). nats-py's ``flush()`` writes its PING straight to the socket, ahead of commands
    still waiting for the client's flusher task, so its PONG proves nothing about them (a SUB just
    made missed a message published after one flush in 109 of 2,000 tries here); the second
    flush's PING leaves after them."""
    await nc.flush()
    await nc.flush()


async def _records(nc: NATS, kv: KeyValue, bucket: str, model) -> list[Any]:
    """The value of every key of ``bucket`` (``kv``) as a ``model``, deleted keys left out."""
    out = []
    for key in sorted(await bucket_keys(nc, bucket)):
        try:
            entry = await kv.get(key)
        except (NotFoundError, KeyError):
            continue
        if entry.value:
            out.append(model.model_validate_json(entry.value))
    return out


async def snapshot(
    nats_url: str, pipeline: PipelineConfig, credentials: NatsAuth | None = None
) -> dict[str, Any]:
    """Streams, consumers, live services and in-flight requests as plain data (read as
    ``credentials``, by default the identity the environment names; the ``operator`` identity may)."""
    subjects = Subjects(pipeline.name)
    nc = await connect(nats_url, "omnirelay-inspect", credentials)
    try:
        js = nc.jetstream()
        services = sorted(
            (
                r
                for r in await _records(nc, await services_kv(js), SERVICES_BUCKET, ServiceRecord)
                if r.pipeline == pipeline.name
            ),
            key=lambda r: r.key,
        )
        requests = [
            r
            for r in await _records(nc, await requests_kv(js), REQUESTS_BUCKET, RequestRecord)
            if r.pipeline == pipeline.name and not r.status.terminal
        ]
        return {
            "pipeline": pipeline.name,
            "streams": await _streams(js, subjects),
            "consumers": await _consumers(js, subjects, pipeline),
            "services": [s.model_dump(mode="json") | {"key": s.key} for s in services],
            "inflight": [r.model_dump(mode="json") for r in requests],
        }
    finally:
        await nc.close()


async def _streams(js: JetStreamContext, subjects: Subjects) -> list[dict[str, Any]]:
    """Messages, bytes and consumers of the pipeline's three streams."""
    streams: list[dict[str, Any]] = []
    for name in (subjects.requests_stream, subjects.stages_stream, subjects.events_stream):
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            streams.append({"stream": name, "missing": True})
            continue
        state = info.state
        streams.append(
            {
                "stream": name,
                "messages": state.messages,
                "bytes": state.bytes,
                "consumers": state.consumer_count,
            }
        )
    return streams


async def _consumers(
    js: JetStreamContext, subjects: Subjects, pipeline: PipelineConfig
) -> list[dict[str, Any]]:
    """What waits for each declared stage replica's consumer."""
    consumers: list[dict[str, Any]] = []
    for s, stage in enumerate(pipeline.stages):
        for r in range(stage.replicas):
            row: dict[str, Any] = {
                "stage": s,
                "name": stage.name,
                "replica": r,
                "consumer": consumer_name(s, r),
            }
            try:
                ci = await js.consumer_info(subjects.stages_stream, consumer_name(s, r))
                row.update(
                    pending=ci.num_pending,
                    ack_pending=ci.num_ack_pending,
                    redelivered=ci.num_redelivered,
                    waiting=ci.num_waiting,
                )
            except NotFoundError:
                row["missing"] = True
            consumers.append(row)
    return consumers


async def request_record(
    nats_url: str, request_id: str, credentials: NatsAuth | None = None
) -> dict[str, Any] | None:
    """The ``omni_requests`` record of ``request_id`` as JSON data, or None when there is none."""
    nc = await connect(nats_url, "omnirelay-inspect", credentials)
    try:
        kv = await requests_kv(nc.jetstream())
        try:
            entry = await kv.get(request_id)
        except (NotFoundError, KeyError):
            return None
        return json.loads(entry.value) if entry.value else None
    finally:
        await nc.close()
