"""A thinker replica killed with SIGKILL while it streams: the orchestrator notices within a probe
period, the streams it held end at once with a clear error (not at their deadline, not at its
restart), the streams on the other replica complete in full, and the eviction is counted once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import openai
import pytest
from openai import AsyncOpenAI

from libs.common.bus import requests_kv
from libs.common.bus_state import request_record, snapshot
from tests.metrics_scrape import delta, scrape
from tests.procs import gone, worker_pid

pytestmark = pytest.mark.e2e

STREAMS, MAX_TOKENS = 6, 1900
FAILED_WITHIN_S = 3.0
"""How soon after the kill the orchestrator must have failed a request bound to the dead replica
(its record's update time, wall clock), seconds."""
CLIENT_LAG_S = 8.0
"""How much later than the orchestrator's verdict the client may read the error: the test's own
client reads six streams of ~1000 chunks a second on a two-core box and runs behind the server."""


@dataclass
class Seen:
    """What one client saw of its stream (``time.monotonic()`` readings)."""

    id: str = ""
    chunks: int = 0
    tokens: int | None = None
    error: openai.APIError | None = None
    error_at: float = 0.0


async def _stream(client: AsyncOpenAI, model: str, seen: Seen) -> None:
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me everything."}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            seen.id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                seen.chunks += 1
            if chunk.usage is not None:
                seen.tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        seen.error, seen.error_at = e, time.monotonic()


async def _streams_and_victim(stack, pipeline):
    """Start ``STREAMS`` streams; as soon as at least two run in stage 0, pick the replica with the
    most of them. Returns (client, what each client saw, their tasks, the victim replica)."""
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    seen = [Seen() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(_stream(client, pipeline.served_model_name, s)) for s in seen]
    nc = await nats.connect(stack.nats_url)
    try:
        kv = await requests_kv(nc.jetstream())
        running: dict[str, int] = {}
        for _ in range(600):
            recs = [json.loads((await kv.get(s.id)).value) for s in seen if s.id]
            running = {r["request_id"]: r["route"][0] for r in recs if not r["stages"][0]["done_ns"]}
            if len(running) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    assert running, "no stream was running in stage 0"
    assert all(s.error is None for s in seen), [str(s.error) for s in seen if s.error]
    return client, seen, tasks, max(set(running.values()), key=list(running.values()).count)


async def _outcomes(
    stack, seen: list[Seen], victim: int, fault_s: float, fault_ns: int, low_s: float, high_s: float
) -> dict[str, float]:
    """Check every stream's end against the fault of replica ``victim`` at ``fault_s`` (monotonic)
    / ``fault_ns`` (wall). A stream bound to the victim either got ``replica_lost`` — its record
    failed between ``low_s`` and ``high_s`` after the fault — or finished in full before the fault;
    every other stream completed in full. Returns the streams the fault cut: id → seconds from the
    fault to their failure (a stream cut before its first chunk has no id: keyed by position)."""
    lost: dict[str, float] = {}
    for i, s in enumerate(seen):
        if s.error is not None:
            assert s.error.code == "replica_lost", (s.id, s.error)
            assert s.error_at - fault_s <= high_s + CLIENT_LAG_S, f"client error {s.error_at - fault_s:.2f} s"
            failed_s = high_s
            if s.id:
                rec = await request_record(stack.nats_url, s.id)
                assert rec["route"][0] == victim
                assert rec["status"] == "failed" and rec["error"] == "replica_lost"
                failed_s = (rec["updated_ns"] - fault_ns) / 1e9
                assert low_s < failed_s <= high_s, f"failed {failed_s:.2f} s after the fault"
            lost[s.id or f"#{i}"] = failed_s
        else:
            # On the live replica, or finished on the victim just before the fault (its
            # stage_done event still on its way): complete, nothing missing.
            assert s.tokens == MAX_TOKENS and s.chunks > 0, (s.id, s.tokens)
    assert lost, "no stream was cut by the fault"
    return lost


async def test_streams_on_a_killed_replica_fail_fast_and_the_others_complete(stack, pipeline) -> None:
    services = (await snapshot(stack.nats_url, pipeline))["services"]
    incarnations = {s["key"]: s["started_ns"] for s in services}
    (orchestrator,) = [s["metrics_url"] for s in services if s["service"] == "orchestrator"]
    (gateway,) = [s["metrics_url"] for s in services if s["service"] == "gateway"]
    before_o, before_g = scrape(orchestrator), scrape(gateway)

    client, seen, tasks, victim = await _streams_and_victim(stack, pipeline)
    try:
        pid = worker_pid(stack.proc.pid, 0, victim)
        os.kill(pid, signal.SIGKILL)
        killed, killed_ns = time.monotonic(), time.time_ns()
        for _ in range(50):
            if gone(pid):
                break
            await asyncio.sleep(0.1)
        assert gone(pid), f"worker {pid} still running after SIGKILL"

        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        await client.close()
        lost = await _outcomes(stack, seen, victim, killed, killed_ns, 0.0, FAILED_WITHIN_S)
        lag = max(s.error_at - killed for s in seen if s.error is not None)
        print(
            f"{len(lost)} stream(s) on replica {victim}: failed {max(lost.values()):.2f} s after the kill, "
            f"the client read replica_lost {lag:.2f} s after it"
        )

        after_o, after_g = scrape(orchestrator), scrape(gateway)
        assert (
            delta(
                before_o,
                after_o,
                "vllm:omni_replica_evictions_total",
                stage="0",
                replica=str(victim),
                reason="exit",
            )
            == 1
        )
        assert delta(before_g, after_g, "vllm:omni_requests_failed_total", reason="replica_lost") == len(lost)
        assert delta(before_g, after_g, "vllm:omni_requests_success_total", finished_reason="abort") == 0
    finally:
        # Leave the stack whole for the tests after this one: wait for the launcher's replacement
        # (a new incarnation in the registry), not for /health alone, which still counts the dead
        # replica until its registration expires.
        key = f"worker.{pipeline.name}.0.{victim}"
        for _ in range(600):
            now = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}
            if key in now and now[key]["started_ns"] > incarnations[key]:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the killed replica did not come back")
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as http:
            assert (await http.get("/health")).json()["status"] == "ok"


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``T`` when stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_streams_on_a_stopped_replica_fail_after_the_stall_timeout(stack, pipeline) -> None:
    """SIGSTOP: the process lives and holds its connection, but answers nothing. Its streams fail
    ``stall_timeout_s`` later; after SIGCONT it stops the work it no longer owns."""
    stall_s = pipeline.stages[0].stall_timeout_s
    services = (await snapshot(stack.nats_url, pipeline))["services"]
    (orchestrator,) = [s["metrics_url"] for s in services if s["service"] == "orchestrator"]
    before = scrape(orchestrator)

    client, seen, tasks, victim = await _streams_and_victim(stack, pipeline)
    pid = worker_pid(stack.proc.pid, 0, victim)
    os.kill(pid, signal.SIGSTOP)
    stopped, stopped_ns = time.monotonic(), time.time_ns()
    try:
        for _ in range(50):
            if _state(pid) == "T":
                break
            await asyncio.sleep(0.05)
        assert _state(pid) == "T", "the worker did not stop"
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        os.kill(pid, signal.SIGCONT)
        resumed_ns = time.time_ns()
    await client.close()
    lost = await _outcomes(stack, seen, victim, stopped, stopped_ns, stall_s - 1.0, stall_s + 2.0)
    print(
        f"{len(lost)} stream(s) on stopped replica {victim}: failed {max(lost.values()):.2f} s after SIGSTOP"
    )
    after = scrape(orchestrator)
    assert (
        delta(
            before, after, "vllm:omni_replica_evictions_total", stage="0", replica=str(victim), reason="stall"
        )
        == 1
    )
    # Resumed, the worker reads the aborts that waited for it (the orchestrator's and the
    # gateway's) and stops the requests it lost, or finishes one whose tokens its engine had made
    # meanwhile (the gateway has closed those streams): either way it is idle again, soon.
    key = f"worker.{pipeline.name}.0.{victim}"
    for _ in range(60):
        rec = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}.get(key)
        if rec and rec["heartbeat_ns"] > resumed_ns and rec["load"] == 0:
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"the resumed worker still holds work: {rec}")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as http:
        for _ in range(60):
            if (await http.get("/health")).json()["status"] == "ok":
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the resumed replica did not come back to the registry")
