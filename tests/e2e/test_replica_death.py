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
FAILED_WITHIN_S = 2.0
"""How soon after the kill the orchestrator must have failed a request bound to the dead replica
(its record's update time, wall clock), seconds."""
CLIENT_ERROR_WITHIN_S = 10.0
"""How soon after the kill the client must have read the error. Looser: the test's own client
reads six streams of ~1000 chunks a second on a two-core box and runs behind the server."""


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


async def test_streams_on_a_killed_replica_fail_fast_and_the_others_complete(stack, pipeline) -> None:
    services = (await snapshot(stack.nats_url, pipeline))["services"]
    incarnations = {s["key"]: s["started_ns"] for s in services}
    (orchestrator,) = [s["metrics_url"] for s in services if s["service"] == "orchestrator"]
    (gateway,) = [s["metrics_url"] for s in services if s["service"] == "gateway"]
    before_o, before_g = scrape(orchestrator), scrape(gateway)

    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    seen = [Seen() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(_stream(client, pipeline.served_model_name, s)) for s in seen]
    # Kill, as soon as streams flow, the replica with the most requests unfinished in stage 0;
    # those are doomed. (A stream that finished there before the kill must complete normally.)
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
    victim = max(set(running.values()), key=list(running.values()).count)
    doomed = {rid for rid, r in running.items() if r == victim}
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
    lost = set()
    for s in seen:
        if s.id in doomed and s.error is not None:
            assert s.error.code == "replica_lost", (s.id, s.error)
            rec = await request_record(stack.nats_url, s.id)
            assert rec["status"] == "failed" and rec["error"] == "replica_lost"
            failed_s = (rec["updated_ns"] - killed_ns) / 1e9
            assert 0 < failed_s <= FAILED_WITHIN_S, f"failed {failed_s:.2f} s after the kill"
            assert s.error_at - killed <= CLIENT_ERROR_WITHIN_S, f"client error {s.error_at - killed:.2f} s"
            lost.add(s.id)
        else:
            # On the live replica, or finished on the victim just before the kill (its stage_done
            # event still on its way): complete, nothing missing.
            assert s.error is None, (s.id, s.error)
            assert s.tokens == MAX_TOKENS and s.chunks > 0
    assert lost, "no stream was cut by the kill"
    doomed = lost
    lag = max(s.error_at - killed for s in seen if s.id in doomed)
    print(
        f"{len(doomed)} stream(s) on replica {victim}: the client read replica_lost {lag:.2f} s after the kill"
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
    assert delta(before_g, after_g, "vllm:omni_requests_failed_total", reason="replica_lost") == len(doomed)
    assert delta(before_g, after_g, "vllm:omni_requests_success_total", finished_reason="abort") == 0

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
