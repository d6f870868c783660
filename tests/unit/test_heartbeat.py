"""The heartbeat's schedule when the broker is slow to acknowledge a write (a fault a real
nats-server cannot be made to produce on demand, so the bucket here is a stand-in that delays
its acknowledgements): the beats stay a period apart from their starts, a write that is never
acknowledged is given up after one period, and a write stored late is logged."""

from __future__ import annotations

import asyncio
import logging
import re
import time

from libs.common.bus import LIMITS
from libs.common.registry import Heartbeat, ServiceKind, ServiceRecord


class SlowBucket:
    """Records when each ``put`` began and was acknowledged (``time.monotonic()``); the n-th
    put takes ``delays[n]`` seconds (the last delay repeats)."""

    def __init__(self, delays: list[float]) -> None:
        self.delays = delays
        self.began: list[float] = []
        self.stored: list[float] = []

    async def put(self, key: str, value: bytes) -> int:
        self.began.append(time.monotonic())
        await asyncio.sleep(self.delays[min(len(self.began) - 1, len(self.delays) - 1)])
        self.stored.append(time.monotonic())
        return len(self.stored)


def _record() -> ServiceRecord:
    return ServiceRecord(service=ServiceKind.GATEWAY, pipeline="p", instance="hb-test")


async def test_a_slow_acknowledgement_does_not_push_the_next_beat_later() -> None:
    bucket = SlowBucket([0.0, 1.5, 1.5, 1.5])
    beat = Heartbeat(bucket, _record(), lambda: 0)  # type: ignore[arg-type]
    await beat.start()
    try:
        while len(bucket.began) < 4:
            await asyncio.sleep(0.05)
    finally:
        beat._task.cancel()
    gaps = [b - a for a, b in zip(bucket.began, bucket.began[1:], strict=False)]
    # Each beat starts one period after the one before it started, not after its slow ack.
    assert all(abs(g - LIMITS.heartbeat_s) < 0.4 for g in gaps), gaps


async def test_a_write_never_acknowledged_is_given_up_after_a_period_and_a_late_one_is_logged(caplog) -> None:
    bucket = SlowBucket([0.0, 60.0, 60.0, 0.0])
    beat = Heartbeat(bucket, _record(), lambda: 0)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="libs.common.registry"):
        await beat.start()
        try:
            while len(bucket.stored) < 2:
                await asyncio.sleep(0.05)
        finally:
            beat._task.cancel()
    assert len(bucket.began) == 4  # two writes cut after a period each, then one stored
    gaps = [b - a for a, b in zip(bucket.began, bucket.began[1:], strict=False)]
    assert all(abs(g - LIMITS.heartbeat_s) < 0.4 for g in gaps), gaps
    failed = [r.message for r in caplog.records if "heartbeat failed" in r.message]
    late = [r.message for r in caplog.records if "stored" in r.message and "hb-test" in r.message]
    assert len(failed) == 2, caplog.text
    assert len(late) == 1, late
    assert 5.8 <= float(re.search(r"stored ([0-9.]+) s after", late[0]).group(1)) <= 7.0, late
