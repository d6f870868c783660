"""The gateway's hold on one request (:class:`RequestHandle`): its events come out in order and
its one deadline timer ends the stream with a 504 ``timeout`` — not before the deadline, after the
events already queued, never once the stream is over, and without swallowing a hang-up."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.envelopes import ClientEvent, ClientEventType
from services.gateway.errors import APIError
from services.gateway.request_handle import BACKSTOP_S, RequestHandle

WAIT_S = 10.0
"""The most any test here waits for a condition, seconds."""


def handle_expiring_in(seconds: float) -> RequestHandle:
    """A handle whose gateway timeout (deadline + :data:`BACKSTOP_S`) is ``seconds`` from now."""
    return RequestHandle("r1", time.time_ns() + int((seconds - BACKSTOP_S) * 1e9))


def text(seq: int) -> ClientEvent:
    return ClientEvent(request_id="r1", type=ClientEventType.TEXT, text=f"t{seq}", token_ids=[seq])


async def drain(handle: RequestHandle, into: list[str]) -> None:
    async for ev in handle.events():
        into.append(ev.text)


async def test_silence_ends_the_stream_with_a_timeout_at_the_deadline_not_before() -> None:
    handle = handle_expiring_in(0.3)
    got: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        await asyncio.wait_for(drain(handle, got), WAIT_S)
    waited = time.monotonic() - t0
    assert (e.value.status, e.value.code) == (504, "timeout")
    assert got == []
    assert waited >= 0.25, f"timed out {waited:.3f} s in, before its deadline"


async def test_events_keep_flowing_before_the_deadline_and_the_timeout_comes_after_them() -> None:
    handle = handle_expiring_in(0.5)
    got: list[str] = []
    consumer = asyncio.create_task(drain(handle, got))
    for seq in range(5):
        handle.put(text(seq))
        await asyncio.sleep(0)  # the consumer takes it before the next comes
    with pytest.raises(APIError) as e:
        await asyncio.wait_for(consumer, WAIT_S)
    assert e.value.code == "timeout"
    assert got == [f"t{seq}" for seq in range(5)]


async def test_events_queued_before_an_expired_deadline_still_go_out_first() -> None:
    handle = handle_expiring_in(-1.0)
    for seq in range(3):
        handle.put(text(seq))
    got: list[str] = []
    with pytest.raises(APIError) as e:
        await asyncio.wait_for(drain(handle, got), WAIT_S)
    assert e.value.code == "timeout"
    assert got == ["t0", "t1", "t2"]


async def test_a_stream_that_ended_leaves_no_timer_behind() -> None:
    handle = handle_expiring_in(0.2)
    handle.put(text(0))
    events = handle.events()
    assert (await anext(events)).text == "t0"
    await events.aclose()  # the response ended: the caller stops iterating
    await asyncio.sleep(0.4)  # proving an absence: past the deadline, a live timer had fired
    assert handle.queue.empty(), "the deadline timer outlived the stream"


async def test_a_hang_up_while_an_event_arrives_is_not_swallowed_and_the_event_stays() -> None:
    handle = handle_expiring_in(30.0)
    got: list[str] = []
    consumer = asyncio.create_task(drain(handle, got))
    await asyncio.sleep(0)  # the consumer waits on the empty queue
    handle.put(text(0))  # wakes it ...
    consumer.cancel()  # ... and the hang-up comes in the same loop turn
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(consumer, WAIT_S)
    assert got == []
    assert handle.queue.get_nowait().text == "t0"
