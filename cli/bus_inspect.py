"""``omnirelay inspect``: what the ``nats`` CLI would show about a pipeline, with stage names."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from libs.common.bus_state import request_record, snapshot
from libs.common.pipeline import PipelineConfig


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _moves(rec: dict[str, Any]) -> str:
    """The request's moves off dead replicas: ``<stage>:<from>→<to>`` each, oldest first."""
    moves = []
    for s, stage in enumerate(rec.get("stages", [])):
        attempts = stage.get("attempts", [])
        moves += [f"{s}:{a['replica']}→{b['replica']}" for a, b in itertools.pairwise(attempts)]
    return " ".join(moves) or "-"


def render(snap: dict[str, Any]) -> str:
    now = time.time_ns()
    inflight = [
        {
            "request_id": r["request_id"],
            "status": r["status"],
            "stage": r["current_stage"],
            "route": ",".join(map(str, r["route"])),
            "moves": _moves(r),
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
            + _table(inflight, ["request_id", "status", "stage", "route", "moves", "age_s"]),
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
