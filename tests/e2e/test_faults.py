"""Client disconnects and malformed bus messages: nothing hangs, nothing is orphaned, nothing crashes."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import msgpack
import nats
import pytest

from libs.common import headers as h
from libs.common.subjects import Subjects, consumer_name
from libs.stack.bus_state import request_record, snapshot
from libs.stack.processes import until
from tests.metrics_scrape import delta, scrape

pytestmark = pytest.mark.e2e

TERMINATED = "vllm:omni_bus_messages_terminated_total"


async def _wait_idle(stack, pipeline, timeout_s: float = 10.0) -> dict:
    """Wait until every worker reports no request in flight; returns the last snapshot."""
    loads: dict = {}

    async def idle() -> dict | None:
        snap = await snapshot(stack.nats_url, pipeline)
        loads.clear()
        loads.update({s["key"]: s["load"] for s in snap["services"] if s["service"] == "worker"})
        return snap if loads and not any(loads.values()) else None

    try:
        return await until(idle, "every worker idle", timeout_s, every_s=0.5)
    except AssertionError:
        raise AssertionError(f"workers still busy: {loads}") from None


async def test_client_disconnect_mid_stream_aborts_every_stage(stack, pipeline) -> None:
    warm_up = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
    }
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        # First use of the talker is slow; warm it so the thinker is still busy when we hang up.
        r = await http.post("/v1/chat/completions", json={**warm_up, "modalities": ["text", "audio"]})
        assert r.status_code == 200
    body = {
        "model": pipeline.served_model_name,
        "messages": [{"role": "user", "content": "Talk for a long time."}],
        "max_tokens": 1900,
        "ignore_eos": True,
        "modalities": ["text", "audio"],
        "audio": {"format": "pcm16"},
        "stream": True,
    }
    rid = None
    async with (
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            if any((c["delta"].get("audio") or {}).get("data") for c in chunk["choices"]):
                break  # every stage is busy with this request now
    # The connection is closed here, long before 1900 tokens (7600 codes) could be produced.
    hung_up_ns = time.time_ns()
    assert rid
    await _wait_idle(stack, pipeline)  # no stage goes on working for the request
    rec = None
    for _ in range(50):
        rec = await request_record(stack.nats_url, rid)
        if rec["status"] == "aborted":
            break
        await asyncio.sleep(0.1)
    assert rec["status"] == "aborted" and rec["finish_reason"] == "abort"
    assert rec["error"] == "client disconnected"
    # Every stage stopped the request on the abort, except one that had already finished its
    # part before the hang-up (the thinker can outrun a loaded machine's talker). Every stage had
    # it (the client had audio, made of the talker's codes, made of the thinker's text), none
    # works on anything now (``_wait_idle``), and a stage that finished its part says so in the
    # record even after the request ended (its ``done_ns``): one that did not, stopped.
    for i, stage in enumerate(pipeline.stages):
        if i < pipeline.thinker_stage:  # the listener: a chat request skips it
            continue
        done_ns = rec["stages"][i]["done_ns"]
        if done_ns is not None and done_ns < hung_up_ns:
            assert i == pipeline.thinker_stage, (
                f"{stage.name} finished 7600 codes' worth of work before the hang-up?"
            )
            continue
        if done_ns is not None:
            seen = "\n".join(line for line in stack.log_text().splitlines() if rid in line)
            raise AssertionError(
                f"{stage.name} finished its part at {done_ns} instead of stopping on the abort; hung up "
                f"at {hung_up_ns}, record {rec}; log lines:\n{seen}"
            )


async def test_malformed_stage_messages_are_terminated_and_the_worker_keeps_serving(stack, pipeline) -> None:
    subjects = Subjects(pipeline.name)
    nc = await nats.connect(stack.nats_url)
    try:
        js = nc.jetstream()
        thinker = pipeline.thinker_stage
        addr = {h.TO_STAGE: str(thinker), h.TO_REPLICA: "0"}
        bad = [
            b"\xc1 this is not msgpack",
            msgpack.packb({"request_id": 7, "kind": "start"}),
            msgpack.packb([1, 2, 3]),
        ]
        services = {s["key"]: s for s in (await snapshot(stack.nats_url, pipeline))["services"]}
        metrics_url = services[f"worker.{pipeline.name}.{thinker}.0"]["metrics_url"]
        before = scrape(metrics_url)
        for body in bad:
            await js.publish(subjects.stage_in(thinker, 0), body, headers=addr)

        def terminated() -> float:  # as the worker counts them on its /metrics
            return delta(before, scrape(metrics_url), TERMINATED)

        await until(lambda: terminated() >= len(bad), f"{len(bad)} malformed messages terminated", 15)
        assert terminated() == len(bad)
        ci = await js.consumer_info(subjects.stages_stream, consumer_name(thinker, 0))
        assert ci.num_ack_pending == 0 and ci.num_pending == 0
    finally:
        await nc.close()
    # Both thinker replicas still serve. Routing goes by the load each replica last reported (a
    # heartbeat every 2 s, maybe taken while it was busy with an earlier test's requests), so
    # send bursts until the replica that got the bad messages has served some.
    routes: set[int] = set()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
        body = {
            "model": pipeline.served_model_name,
            "messages": [{"role": "user", "content": "still there?"}],
            "max_tokens": 3,
        }
        for _ in range(5):
            rs = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(6)))
            assert [r.status_code for r in rs] == [200] * 6
            routes |= {(await request_record(stack.nats_url, r.json()["id"]))["route"][thinker] for r in rs}
            if 0 in routes:
                break
            await asyncio.sleep(1.0)
    assert 0 in routes, routes


async def test_inspect_shows_streams_consumers_services(stack, pipeline) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cli", "inspect", "--json", "--nats-url", stack.nats_url,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    snap = json.loads(out)
    subjects = Subjects(pipeline.name)
    assert {s["stream"] for s in snap["streams"]} == {
        subjects.requests_stream,
        subjects.stages_stream,
        subjects.events_stream,
    }
    expected = {(s, st.name, r) for s, st in enumerate(pipeline.stages) for r in range(st.replicas)}
    assert {(c["stage"], c["name"], c["replica"]) for c in snap["consumers"]} == expected
    assert all("pending" in c and "ack_pending" in c and "redelivered" in c for c in snap["consumers"])
    kinds = sorted(s["service"] for s in snap["services"])
    assert kinds.count("worker") == len(expected) and "gateway" in kinds and "orchestrator" in kinds
