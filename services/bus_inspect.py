"""``omnirelay inspect``: what the ``nats`` CLI would show about a pipeline, with stage names."""

from __future__ import annotations

import json
import time
from typing import Any

from nats.js.errors import NoKeysError, NotFoundError

from libs.common.bus import connect, requests_kv, services_kv
from libs.common.pipeline import PipelineConfig
from libs.common.records import RequestRecord
from libs.common.registry import ServiceRecord
from libs.common.subjects import Subjects, consumer_name


async def _records(kv, model) -> list[Any]:
    try:
        keys = await kv.keys()
    except NoKeysError:
        return []
    out = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except (NotFoundError, KeyError):
            continue
        if entry.value:
            out.append(model.model_validate_json(entry.value))
    return out


async def snapshot(nats_url: str, pipeline: PipelineConfig) -> dict[str, Any]:
    """Streams, consumers, live services and in-flight requests as plain data."""
    subjects = Subjects(pipeline.name)
    nc = await connect(nats_url, "omnirelay-inspect")
    try:
        js = nc.jetstream()
        streams = []
        for name in (subjects.requests_stream, subjects.stages_stream, subjects.events_stream):
            try:
                info = await js.stream_info(name)
                streams.append(
                    {
                        "stream": name,
                        "messages": info.state.messages,
                        "bytes": info.state.bytes,
                        "consumers": info.state.consumer_count,
                    }
                )
            except NotFoundError:
                streams.append({"stream": name, "missing": True})
        consumers = []
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
        services = sorted(
            (r for r in await _records(await services_kv(js), ServiceRecord) if r.pipeline == pipeline.name),
            key=lambda r: r.key,
        )
        requests = [
            r
            for r in await _records(await requests_kv(js), RequestRecord)
            if r.pipeline == pipeline.name and not r.status.terminal
        ]
        return {
            "pipeline": pipeline.name,
            "streams": streams,
            "consumers": consumers,
            "services": [s.model_dump(mode="json") | {"key": s.key} for s in services],
            "inflight": [r.model_dump(mode="json") for r in requests],
        }
    finally:
        await nc.close()


async def request_record(nats_url: str, request_id: str) -> dict[str, Any] | None:
    nc = await connect(nats_url, "omnirelay-inspect")
    try:
        kv = await requests_kv(nc.jetstream())
        try:
            entry = await kv.get(request_id)
        except (NotFoundError, KeyError):
            return None
        return json.loads(entry.value) if entry.value else None
    finally:
        await nc.close()


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def render(snap: dict[str, Any]) -> str:
    now = time.time_ns()
    inflight = [
        {
            "request_id": r["request_id"],
            "status": r["status"],
            "stage": r["current_stage"],
            "route": ",".join(map(str, r["route"])),
            "age_s": f"{(now - r['arrival_ns']) / 1e9:.1f}",
        }
        for r in snap["inflight"]
    ]
    services = [
        {
            **s,
            "stage": "" if s["stage"] is None else f"{s['stage']}:{s['stage_name']}",
            "replica": "" if s["replica"] is None else s["replica"],
        }
        for s in snap["services"]
    ]
    return "\n\n".join(
        [
            f"pipeline {snap['pipeline']}",
            "STREAMS\n" + _table(snap["streams"], ["stream", "messages", "bytes", "consumers"]),
            "CONSUMERS\n"
            + _table(
                snap["consumers"],
                ["stage", "name", "replica", "consumer", "pending", "ack_pending", "redelivered", "waiting"],
            ),
            "SERVICES\n"
            + _table(services, ["service", "stage", "replica", "instance", "load", "metrics_url"]),
            f"IN-FLIGHT REQUESTS ({len(inflight)})\n"
            + _table(inflight, ["request_id", "status", "stage", "route", "age_s"]),
        ]
    )


async def run_inspect(nats_url: str, pipeline: PipelineConfig, request_id: str | None, as_json: bool) -> int:
    if request_id:
        rec = await request_record(nats_url, request_id)
        if rec is None:
            print(f"no record for request {request_id!r} (unknown or expired)")
            return 1
        print(json.dumps(rec, indent=2))
        return 0
    snap = await snapshot(nats_url, pipeline)
    print(json.dumps(snap, indent=2) if as_json else render(snap))
    return 0
