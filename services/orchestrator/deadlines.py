"""Deadline enforcement for requests nobody is working on any more (one pipeline's).

Workers stop their own part of a request at its deadline and tell the client; this sweeper
covers the rest: a request still not terminal ``GRACE_S`` after its deadline (queued for a
replica that died, lost between stages, ...) is marked failed, aborted everywhere and answered
with a 504. Every orchestrator instance keeps the same index (a watch of ``omni_requests``);
a compare-and-set on the record makes exactly one of them act.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from libs.common.records import RequestRecord, RequestStatus
from libs.common.runtime import cancel_and_wait
from services.orchestrator.inflight import InflightRequests

log = logging.getLogger(__name__)

GRACE_S = 1.0
"""How long past its deadline a request may stay non-terminal before the sweeper acts, seconds."""
SWEEP_PERIOD_S = 0.5


class DeadlineSweeper:
    def __init__(
        self,
        kv: KeyValue,
        inflight: InflightRequests,
        on_expired: Callable[[RequestRecord], Awaitable[None]],
    ) -> None:
        self._kv = kv
        self._inflight = inflight
        self._on_expired = on_expired
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sweep(), name="deadline-sweep")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            limit = time.time_ns() - int(GRACE_S * 1e9)
            for rid in [r for r, rec in self._inflight.records.items() if rec.deadline_ns < limit]:
                try:
                    await self._expire(rid)
                except Exception as e:
                    log.warning("request %s: deadline handling failed: %s", rid, e)

    async def _expire(self, rid: str) -> None:
        try:
            entry = await self._kv.get(rid)
        except (NotFoundError, KeyError):
            self._inflight.forget(rid)
            return
        rec = RequestRecord.model_validate_json(entry.value)
        if rec.status.terminal:
            self._inflight.forget(rid)
            return
        rec.status, rec.error, rec.updated_ns = RequestStatus.FAILED, "timeout", time.time_ns()
        try:
            await self._kv.update(rid, rec.model_dump_json().encode(), last=entry.revision)
        except KeyWrongLastSequenceError:
            return  # another instance (or a worker's event) got there first; look again next sweep
        self._inflight.forget(rid)
        log.warning("request %s: past its deadline in status %s; failed and aborted", rid, rec.status)
        await self._on_expired(rec)
