"""Stage 0's ``started`` event: once, a short delay after the hand-off or at the first output."""

from __future__ import annotations

import asyncio
import time

from libs.common.envelopes import ClientEventType
from libs.stack.processes import until
from services.stage_worker.handlers.thinker import STARTED_DELAY_S, _StartedNotice


class Recorder:
    """Stands in for a RequestContext: records the client events it is asked to publish."""

    request_id = "r"

    def __init__(self) -> None:
        self.sent: list[tuple[ClientEventType, float]] = []

    async def client(self, event) -> None:
        self.sent.append((event.type, time.monotonic()))


async def test_it_goes_out_after_the_delay_without_an_output() -> None:
    req = Recorder()
    t0 = time.monotonic()
    _StartedNotice(req)
    await until(lambda: req.sent, "the started event sent", every_s=STARTED_DELAY_S / 2)
    assert [t for t, _ in req.sent] == [ClientEventType.STARTED]
    assert req.sent[0][1] - t0 >= STARTED_DELAY_S * 0.9  # not before its delay


async def test_a_first_output_sends_it_at_once_and_only_once() -> None:
    req = Recorder()
    notice = _StartedNotice(req)
    await notice.sent()
    assert len(req.sent) == 1
    # Time passes well beyond the delay: had the timer not been stopped, it would send again.
    await asyncio.sleep(STARTED_DELAY_S + 0.05)
    await notice.sent()
    assert len(req.sent) == 1


async def test_cancelled_before_the_delay_it_never_goes_out() -> None:
    req = Recorder()
    _StartedNotice(req).cancel()
    await asyncio.sleep(STARTED_DELAY_S + 0.05)  # well past the delay: nothing may come in it
    assert req.sent == []
