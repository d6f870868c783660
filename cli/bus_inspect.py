"""``omnirelay inspect``: what the ``nats`` CLI would show about a pipeline, with stage names.

It talks to the NATS :func:`cli.stack_file.resolve_nats_url` chooses (a running ``omnirelay up``
is found through its ``stack.json``) and ends with a clear error within seconds when that NATS
cannot be reached."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from typing import Any

from cli.stack_file import NatsTarget, probe_nats, unreachable_message
from libs.common.pipeline import PipelineConfig
from libs.stack.bus_state import request_record, snapshot


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


INSPECT_TIMEOUT_S = 30.0
"""How long ``inspect`` may take to read the bus once NATS answered, seconds (a server without
JetStream, or one that stops answering, ends it with an error instead of a wait)."""


async def run_inspect(
    target: NatsTarget,
    pipeline: PipelineConfig,
    request_id: str | None,
    as_json: bool,
    timeout_s: float = INSPECT_TIMEOUT_S,
) -> int:
    """Print the bus's state (or one request's record); 0 on success, 1 when the request has no
    record, 2 when NATS cannot be reached (said on stderr within
    :data:`cli.stack_file.PROBE_TIMEOUT_S`) or does not answer within ``timeout_s``."""
    if (error := await probe_nats(target.url, credentials=target.credentials)) is not None:
        print(unreachable_message(target, error), file=sys.stderr)
        return 2
    try:
        if request_id:
            rec = await asyncio.wait_for(
                request_record(target.url, request_id, target.credentials), timeout_s
            )
        else:
            snap = await asyncio.wait_for(snapshot(target.url, pipeline, target.credentials), timeout_s)
    except TimeoutError:
        print(
            f"error: NATS at {target.url} (from {target.source}) accepted the connection but did not "
            f"answer within {timeout_s:g} s: is JetStream enabled, is the server overloaded?",
            file=sys.stderr,
        )
        return 2
    if request_id:
        if rec is None:
            print(f"no record for request {request_id!r} (unknown or expired)")
            return 1
        print(json.dumps(rec, indent=2))
        return 0
    print(json.dumps(snap, indent=2) if as_json else render(snap))
    return 0
