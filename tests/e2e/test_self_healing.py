"""``omnirelay up`` heals itself: a worker killed with SIGKILL is restarted with its identity (its
engine processes die with it), the stack stays up, requests complete meanwhile, ``/health`` names
the stage degraded while it shows it short, and requests complete on the whole stack afterwards."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from benchmarks.process_table import descendants
from libs.common.pipeline import load_pipeline
from libs.stack.bus_state import snapshot
from tests.bus import await_replacement
from tests.procs import gone, worker_pid

pytestmark = pytest.mark.e2e

STAGE, REPLICA = load_pipeline().thinker_stage, 1
"""The worker killed: the default pipeline's second thinker replica (the first serves meanwhile)."""


async def test_a_killed_worker_is_restarted_and_requests_keep_completing(stack, pipeline) -> None:
    stage_key = f"{STAGE}:{pipeline.stages[STAGE].name}"
    before = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}
    record_key = f"worker.{pipeline.name}.{STAGE}.{REPLICA}"
    old_started_ns = before[record_key]["started_ns"]

    body = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "are you still there?"}],
        "max_tokens": 8,
    }
    pid = worker_pid(stack.proc.pid, STAGE, REPLICA)
    engine = descendants(pid)  # its EngineCore (which runs the model: engine_executor.py)
    assert engine, f"worker {pid} has no engine processes"
    log_offset = len(stack.log_text())  # what the stack logged before the fault
    os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        if gone(pid) and all(gone(p) for p in engine):
            break
        await asyncio.sleep(0.1)
    assert gone(pid), f"worker {pid} still running after SIGKILL"
    assert [p for p in engine if not gone(p)] == [], "the killed worker's engine processes outlived it"

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        # While the replica is down, requests complete (on the live one, or moved off the dead).
        during = [await http.post("/v1/chat/completions", json=body) for _ in range(4)]
        assert [r.status_code for r in during] == [200] * 4, [r.text for r in during]
        assert all(r.json()["usage"]["completion_tokens"] > 0 for r in during)
        # Until the replacement registers, /health names the stage degraded once the dead
        # incarnation's registration expired (a replacement forked within its TTL comes first).
        replaced = asyncio.ensure_future(
            await_replacement(stack.nats_url, pipeline, record_key, old_started_ns, timeout_s=240)
        )
        while not replaced.done():
            h = await http.get("/health")
            health = h.json()
            assert h.status_code == 200, health  # thinker-0 is live the whole time
            assert stack.proc.poll() is None, "omnirelay up stopped"
            if health["status"] == "degraded":
                assert health["degraded"] == [stage_key] and health["stages"][stage_key] == REPLICA
            await asyncio.sleep(0.2)
        await replaced
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["stages"][stage_key] == pipeline.stages[STAGE].replicas
        after = [await http.post("/v1/chat/completions", json=body) for _ in range(4)]
        assert [r.status_code for r in after] == [200] * 4

    assert worker_pid(stack.proc.pid, STAGE, REPLICA) != pid  # health is whole again: a new process
    # The replacement took the identity back (awaited above). A replacement whose heartbeat slipped
    # past the entry's TTL would vanish from routing: each service logs a write stored more than
    # LATE_BEATS periods after the one before, and none may show up for it.
    since = stack.log_text()[log_offset:].splitlines()
    late = [line for line in since if "heartbeat of " + record_key in line]
    assert late == [], late
