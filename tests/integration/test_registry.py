"""Heartbeats against a real nats-server: a load that fell by half (a finished burst) reaches the
registry within a fraction of the heartbeat period; small changes wait for the regular beat.

Early and late are told apart at half a heartbeat period: an early write comes within
``MIN_BEAT_GAP_S`` (a few hundredths of a second once that has passed), the regular beat a whole
period after the last; a busy machine makes either a little late, never a second late."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from libs.common.bus import LIMITS, services_kv
from libs.common.registry import Heartbeat, LiveServices, ServiceKind, ServiceRecord
from libs.stack.processes import until

pytestmark = pytest.mark.integration


async def _shown_load(kv, key: str) -> int:
    return ServiceRecord.model_validate_json((await kv.get(key)).value).load


async def _until(kv, key: str, load: int, timeout_s: float) -> None:
    """Wait until the registry shows ``load`` for ``key`` (fails after ``timeout_s``)."""

    async def shown() -> bool:
        return await _shown_load(kv, key) == load

    await until(shown, f"load {load} shown", timeout_s, every_s=0.02)


@pytest.mark.parametrize("before, after, early", [(16, 0, True), (8, 4, True), (9, 8, False), (1, 0, False)])
async def test_a_halved_load_is_shown_early_and_small_changes_wait(nats_server, before, after, early) -> None:
    nc = await nats.connect(nats_server.url)
    kv = await services_kv(nc.jetstream())
    load = before
    rec = ServiceRecord(service=ServiceKind.WORKER, pipeline="hb", instance="i", stage=0, replica=before)
    beat = Heartbeat(kv, rec, lambda: load)
    try:
        began = time.monotonic()
        await beat.start()
        assert await _shown_load(kv, rec.key) == before
        load = after
        dropped = time.monotonic()
        beat.load_dropped()
        await _until(kv, rec.key, after, 3 * LIMITS.heartbeat_s)
        if early:  # (an early write comes no sooner than ``MIN_BEAT_GAP_S`` after the one before)
            assert time.monotonic() - dropped < LIMITS.heartbeat_s / 2, "not written early"
        else:  # by the regular beat, a period after the first
            assert time.monotonic() - began > LIMITS.heartbeat_s, "written early"
    finally:
        await beat.stop()
        await nc.close()


async def test_an_expired_replica_is_not_live_but_its_silence_is_known(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    kv = await services_kv(nc.jetstream())
    rec = ServiceRecord(service=ServiceKind.WORKER, pipeline="ttl", instance="i", stage=0, replica=3)
    live = LiveServices(kv, "ttl", ttl_s=0.3)
    try:
        await kv.put(rec.key, rec.model_dump_json().encode())
        await live.start()
        await asyncio.wait_for(live.ready.wait(), 5)
        assert [r.replica for r in live.live(ServiceKind.WORKER, 0)] == [3]
        await asyncio.sleep(0.5)  # the thing under test: time passes beyond the TTL with no beat
        assert live.live(ServiceKind.WORKER, 0) == []
        [(heard, age)] = live.last_heard(ServiceKind.WORKER, 0)
        assert heard.replica == 3 and 0.5 <= age < 5
        assert live.last_heard(ServiceKind.WORKER, 1) == [] and live.last_heard(ServiceKind.GATEWAY) == []
        await kv.delete(rec.key)
        await until(lambda: not live.last_heard(ServiceKind.WORKER), "the deletion reaches the watcher")
    finally:
        await live.stop()
        await nc.close()


async def test_a_beat_overdue_after_a_stall_is_written_at_once(nats_server) -> None:
    """A process stopped (or starved) past its beat writes it as soon as it runs again; readers
    count a replica dead ``service_ttl_s`` after its last beat, so a period's wait would lose it."""
    nc = await nats.connect(nats_server.url)
    kv = await services_kv(nc.jetstream())
    rec = ServiceRecord(service=ServiceKind.WORKER, pipeline="stall", instance="i", stage=0, replica=0)
    beat = Heartbeat(kv, rec, lambda: 0)
    try:
        await beat.start()
        first = (await kv.get(rec.key)).revision  # a round trip: the beat loop has begun its wait
        assert not beat._task.done()
        time.sleep(LIMITS.heartbeat_s + 0.5)  # the fault: the whole event loop stalls past the next beat
        t0 = time.monotonic()
        while (await kv.get(rec.key)).revision == first:
            assert time.monotonic() - t0 < LIMITS.heartbeat_s, "no beat after the stall"
            await asyncio.sleep(0.01)
        # at once, not a period later (half a period tells the two apart on a busy machine)
        assert time.monotonic() - t0 < LIMITS.heartbeat_s / 2
    finally:
        await beat.stop()
        await nc.close()
