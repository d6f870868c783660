"""Heartbeats against a real nats-server: a load that fell by half (a finished burst) reaches the
registry within a fraction of the heartbeat period; small changes wait for the regular beat."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from libs.common.bus import LIMITS, services_kv
from libs.common.registry import MIN_BEAT_GAP_S, Heartbeat, LiveServices, ServiceKind, ServiceRecord

pytestmark = pytest.mark.integration


async def _shown_load(kv, key: str) -> int:
    return ServiceRecord.model_validate_json((await kv.get(key)).value).load


async def _until(kv, key: str, load: int, timeout_s: float) -> float:
    """Seconds until the registry shows ``load`` for ``key`` (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while await _shown_load(kv, key) != load:
        assert time.monotonic() - t0 < timeout_s, f"load {load} not shown within {timeout_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("before, after, early", [(16, 0, True), (8, 4, True), (9, 8, False), (1, 0, False)])
async def test_a_halved_load_is_shown_early_and_small_changes_wait(nats_server, before, after, early) -> None:
    nc = await nats.connect(nats_server.url)
    kv = await services_kv(nc.jetstream())
    load = before
    rec = ServiceRecord(service=ServiceKind.WORKER, pipeline="hb", instance="i", stage=0, replica=before)
    beat = Heartbeat(kv, rec, lambda: load)
    try:
        await beat.start()
        assert await _shown_load(kv, rec.key) == before
        await asyncio.sleep(MIN_BEAT_GAP_S)
        load = after
        beat.load_dropped()
        took = await _until(kv, rec.key, after, LIMITS.heartbeat_s + 1)
        if early:
            assert took < 2 * MIN_BEAT_GAP_S, took
        else:
            assert took > LIMITS.heartbeat_s - 2 * MIN_BEAT_GAP_S, took
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
        await asyncio.sleep(0.5)
        assert live.live(ServiceKind.WORKER, 0) == []
        [(heard, age)] = live.last_heard(ServiceKind.WORKER, 0)
        assert heard.replica == 3 and 0.5 <= age < 5
        assert live.last_heard(ServiceKind.WORKER, 1) == [] and live.last_heard(ServiceKind.GATEWAY) == []
        await kv.delete(rec.key)
        for _ in range(100):  # the deletion reaches the watcher
            if not live.last_heard(ServiceKind.WORKER):
                break
            await asyncio.sleep(0.02)
        assert live.last_heard(ServiceKind.WORKER) == []
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
        first = (await kv.get(rec.key)).revision
        await asyncio.sleep(MIN_BEAT_GAP_S / 2)  # the beat loop waits out its minimum gap
        time.sleep(LIMITS.heartbeat_s + 0.5)  # the whole event loop stalls past the next beat
        t0 = time.monotonic()
        while (await kv.get(rec.key)).revision == first:
            assert time.monotonic() - t0 < LIMITS.heartbeat_s, "no beat after the stall"
            await asyncio.sleep(0.01)
        assert time.monotonic() - t0 < 0.5
    finally:
        await beat.stop()
        await nc.close()
