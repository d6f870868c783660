"""The heartbeat's schedule when the broker is slow to acknowledge a write (a fault a real
nats-server cannot be made to produce on demand, so the bucket here is a stand-in that delays
its acknowledgements): the beats stay a period apart from their starts, a write that is never
acknowledged is given up after one period, and a write stored late is logged."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time

from libs.common.registry import LATE_BEATS, MIN_BEAT_GAP_S, Heartbeat, ServiceKind, ServiceRecord
from libs.stack.processes import until


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


PERIOD_S = 1.0
"""The heartbeat period of these tests, seconds (a service's is ``LIMITS.heartbeat_s``)."""


def _record() -> ServiceRecord:
    return ServiceRecord(service=ServiceKind.GATEWAY, pipeline="p", instance="hb-test")


def assert_a_period_apart(began: list[float], pushed_by_s: float, given_up: tuple[int, ...] = ()) -> None:
    """Each write began a period after the one before it began (and the minimum gap more after a
    write given up, whose index is in ``given_up``): not sooner (timers do not fire early), and
    nearer to that than to ``pushed_by_s`` later, where a wrong schedule would put it (one that
    waited for the acknowledgement, or for a write never acknowledged); however late a busy
    machine runs a timer, it does not run it that late."""
    for i, (a, b) in enumerate(itertools.pairwise(began)):
        due = PERIOD_S + (MIN_BEAT_GAP_S if i in given_up else 0.0)
        assert due - 0.01 <= b - a < due + pushed_by_s / 2, (i, b - a, began)


async def test_a_slow_acknowledgement_does_not_push_the_next_beat_later() -> None:
    slow_s = 0.75 * PERIOD_S
    bucket = SlowBucket([0.0, slow_s, slow_s, slow_s])
    beat = Heartbeat(bucket, _record(), lambda: 0, period_s=PERIOD_S)  # type: ignore[arg-type]
    await beat.start()
    try:
        await until(lambda: len(bucket.began) >= 4, "four writes begun", timeout_s=6 * PERIOD_S)
    finally:
        beat._task.cancel()
    # Each beat starts one period after the one before it started, not after its slow ack.
    assert_a_period_apart(bucket.began, pushed_by_s=slow_s)


async def test_a_write_never_acknowledged_is_given_up_after_a_period_and_a_late_one_is_logged(caplog) -> None:
    bucket = SlowBucket([0.0, 60.0, 60.0, 0.0])
    beat = Heartbeat(bucket, _record(), lambda: 0, period_s=PERIOD_S)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="libs.common.registry"):
        await beat.start()
        try:
            await until(lambda: len(bucket.stored) >= 2, "a second write stored", timeout_s=6 * PERIOD_S)
        finally:
            beat._task.cancel()
    assert len(bucket.began) == 4  # two writes cut after a period each, then one stored
    # (a write given up later than a period after it began would push the next one as much later)
    assert_a_period_apart(bucket.began, pushed_by_s=PERIOD_S, given_up=(1, 2))
    failed = [r.message for r in caplog.records if "heartbeat failed" in r.message]
    late = [r.message for r in caplog.records if "stored" in r.message and "hb-test" in r.message]
    assert len(failed) == 2, caplog.text
    assert len(late) == 1, late
    # The gap it logs is the one the bucket saw between the two stored writes (to the 0.1 s the
    # line shows), three periods: past the threshold of a late beat.
    logged = float(re.search(r"stored ([0-9.]+) s after", late[0]).group(1))
    seen = bucket.stored[1] - bucket.stored[0]
    assert seen > LATE_BEATS * PERIOD_S and abs(logged - seen) < 0.25, (logged, seen)
