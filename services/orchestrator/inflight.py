"""Every request of one pipeline that is not terminal yet, as the ``omni_requests`` bucket says.

Each orchestrator instance keeps the same index from a watch of the bucket: the deadline sweeper
reads deadlines from it, the replica watch reads which replica each request is bound to. Acting on
a record goes through a compare-and-set on it, so instances never act twice.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.js.kv import KeyValue
from pydantic import ValidationError

from libs.common.records import RequestRecord
from libs.common.runtime import cancel_and_wait


class InflightRequests:
    def __init__(self, kv: KeyValue, pipeline: str) -> None:
        self._kv = kv
        self._pipeline = pipeline
        self.records: dict[str, RequestRecord] = {}
        """Request id → its latest non-terminal record."""
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.records)

    def forget(self, request_id: str) -> None:
        """Drop a request known to be terminal (its record may not have said so yet)."""
        self.records.pop(request_id, None)

    def bound_to(self, stage: int, replica: int) -> list[RequestRecord]:
        """Requests whose ``stage`` runs on ``replica`` and has not finished there."""
        return [
            rec
            for rec in self.records.values()
            if len(rec.route) > stage and rec.route[stage] == replica and not _done(rec, stage)
        ]

    def busy(self) -> set[tuple[int, int]]:
        """(stage, replica) of every replica with a request bound to it and not finished there."""
        return {(s, r) for rec in self.records.values() for s, r in enumerate(rec.route) if not _done(rec, s)}

    async def start(self) -> None:
        watcher = await self._kv.watchall()
        self._task = asyncio.create_task(self._watch(watcher), name="inflight-watch")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _watch(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is None:
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    self.records.pop(entry.key, None)
                    continue
                try:
                    rec = RequestRecord.model_validate_json(entry.value)
                except ValidationError:
                    continue
                if rec.pipeline != self._pipeline:
                    continue
                if rec.status.terminal:
                    self.records.pop(entry.key, None)
                else:
                    self.records[entry.key] = rec
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def _done(rec: RequestRecord, stage: int) -> bool:
    return len(rec.stages) > stage and rec.stages[stage].done_ns is not None
