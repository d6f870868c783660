"""``omnirelay up`` heals itself: a worker killed with SIGKILL is restarted with its identity, the
stack stays up, ``/health`` names the degraded stage meanwhile, and requests keep completing."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import descendants
from libs.common.bus_state import snapshot

pytestmark = pytest.mark.e2e

STAGE, REPLICA = 0, 1


def worker_pid(root: int, stage: int, replica: int) -> int:
    """The pid of the worker process (stage, replica) under the ``omnirelay up`` process ``root``."""
    want = {f"OMNIRELAY_STAGE={stage}", f"OMNIRELAY_REPLICA={replica}"}
    found = []
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            env = set(Path(f"/proc/{pid}/environ").read_text().split("\0"))
        except OSError:
            continue
        if argv[1:4] == ["-m", "cli", "worker"] and want <= env:
            found.append(pid)
    assert len(found) == 1, found
    return found[0]


def gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_killed_worker_is_restarted_and_requests_keep_completing(stack, pipeline) -> None:
    stage_key = f"{STAGE}:{pipeline.stages[STAGE].name}"
    name = f"{pipeline.stages[STAGE].name}-{REPLICA}"
    before = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}
    record_key = f"worker.{pipeline.name}.{STAGE}.{REPLICA}"
    old_started_ns = before[record_key]["started_ns"]

    pid = worker_pid(stack.proc.pid, STAGE, REPLICA)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    for _ in range(50):
        if gone(pid):
            break
        await asyncio.sleep(0.1)
    assert gone(pid), f"worker {pid} still running after SIGKILL"

    body = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "are you still there?"}],
        "max_tokens": 8,
    }
    seen_degraded = False
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=180) as http:
        # Requests sent while the replica is down: some may be bound to it before its registration
        # expires; they wait in its durable consumer for the replacement.
        during = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(4)]
        while time.monotonic() - killed < 240:
            h = await http.get("/health")
            health = h.json()
            assert h.status_code == 200, health  # thinker-0 is live the whole time
            assert stack.proc.poll() is None, "omnirelay up stopped"
            if health["status"] == "degraded":
                assert health["degraded"] == [stage_key] and health["stages"][stage_key] == REPLICA
                seen_degraded = True
            elif seen_degraded and health["status"] == "ok":
                break
            await asyncio.sleep(0.2)
        assert seen_degraded, "health never named the degraded stage"
        assert health["status"] == "ok" and health["stages"][stage_key] == pipeline.stages[STAGE].replicas
        responses = await asyncio.gather(*during)
        assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] > 0 for r in responses)
        after = [await http.post("/v1/chat/completions", json=body) for _ in range(4)]
        assert [r.status_code for r in after] == [200] * 4

    line = await stack.await_log(f"omnirelay: {name} (pid {pid}) ended with signal 9 (SIGKILL)")
    assert "restart 1 in" in line
    await stack.await_log(f"omnirelay: {name} restarted (pid ")
    new_pid = worker_pid(stack.proc.pid, STAGE, REPLICA)
    assert new_pid != pid
    now = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}
    assert now[record_key]["started_ns"] > old_started_ns  # the replacement took the identity back
