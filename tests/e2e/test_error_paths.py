"""A client that hangs up on a non-streamed request (docs/api.md: "A client that hangs up before its
response began gets nothing more (logged as 499); the request is aborted in every stage";
docs/contract.md, "Reliability": finished_reason ``abort``; docs/metrics.md: counted as
``vllm:omni_requests_success_total{finished_reason="abort"}``, never as a failure). The whole
stack, the official ``openai`` client; the request is found on the bus by the trace id the client
sent in its ``traceparent``."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import pytest

from libs.stack.bus_state import request_record, snapshot
from libs.stack.processes import until
from tests.metrics_scrape import delta, scrape, total

pytestmark = pytest.mark.e2e

SUCCESS, FAILED = "vllm:omni_requests_success_total", "vllm:omni_requests_failed_total"
RUNNING = "vllm:omni_num_requests_running"


async def _inflight_with_trace(stack, pipeline, trace_id: str, timeout_s: float = 30.0) -> dict:
    """The in-flight record of the request of ``trace_id`` once every stage has started it (the
    listener a chat skips)."""

    async def started() -> dict | None:
        for rec in (await snapshot(stack.nats_url, pipeline))["inflight"]:
            if rec["trace_id"] == trace_id and all(
                s["started_ns"] for s in rec["stages"][pipeline.thinker_stage :]
            ):
                return rec
        return None

    return await until(started, f"the request of trace {trace_id} at every stage", timeout_s, every_s=0.1)


async def _record_until(stack, rid: str, status: str, timeout_s: float = 15.0) -> dict:
    async def reached() -> dict | None:
        rec = await request_record(stack.nats_url, rid)
        return rec if rec is not None and rec["status"] == status else None

    return await until(reached, f"the record of {rid} {status}", timeout_s, every_s=0.1)


async def _idle(stack, pipeline, timeout_s: float = 15.0) -> None:
    """Every worker reports no request in flight (its registered load)."""

    async def idle() -> bool:
        snap = await snapshot(stack.nats_url, pipeline)
        loads = {s["key"]: s["load"] for s in snap["services"] if s["service"] == "worker"}
        return bool(loads) and not any(loads.values())

    await until(idle, "every worker idle", timeout_s, every_s=0.25)


async def test_a_client_that_leaves_a_non_streamed_request_aborts_it_in_every_stage(stack, pipeline) -> None:
    metrics = f"{stack.admin_url}/metrics"
    await _idle(stack, pipeline)  # what a test before left running has ended
    trace_id = secrets.token_hex(16)
    client = stack.client(120, traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")
    before = scrape(metrics)
    call = asyncio.create_task(
        client.chat.completions.create(
            model=pipeline.served_model_name,
            messages=[{"role": "user", "content": "Talk for a long time."}],
            max_tokens=1900,  # 7600 codes: minutes of work for the talker and code2wav
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
            extra_body={"ignore_eos": True},
        )
    )
    rec = await _inflight_with_trace(stack, pipeline, trace_id)
    rid = rec["request_id"]
    assert not call.done(), "the response came before the client could leave"
    running = total(scrape(metrics), RUNNING)
    # The client leaves: its task is cancelled and its connections closed.
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    await client.close()
    assert call.cancelled() and client.is_closed()
    hung_up_ns = time.time_ns()

    rec = await _record_until(stack, rid, "aborted")
    assert (rec["finish_reason"], rec["error"]) == ("abort", "client disconnected"), rec
    for i, stage in enumerate(pipeline.stages):
        done_ns = rec["stages"][i]["done_ns"]
        # the listener a chat skips (done at admission), and the thinker, which can outrun a
        # loaded machine's talker, may have ended before the hang-up; no later stage can
        assert done_ns is None or done_ns >= hung_up_ns or i <= pipeline.thinker_stage, (
            f"{stage.name} finished 7600 codes' worth of work before the hang-up?"
        )
    await _idle(stack, pipeline)  # every stage stopped its part: no worker holds a request

    # the gateway records the request a moment after it aborted it
    await until(
        lambda: delta(before, scrape(metrics), SUCCESS, finished_reason="abort") >= 1,
        "the abort counted",
        timeout_s=5,
        every_s=0.1,
    )
    after = scrape(metrics)
    assert delta(before, after, SUCCESS, finished_reason="abort") == 1
    assert delta(before, after, SUCCESS) == 1 and delta(before, after, FAILED) == 0
    assert total(after, RUNNING) == running - 1, "the request is still counted as running"
    # The 499 nobody received: in the gateway's http_* families.
    assert delta(before, after, "http_requests_total", handler="/v1/chat/completions", status="4xx") == 1
