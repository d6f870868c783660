"""Every request of one pipeline that is not terminal yet, from a watch of the ``omni_requests``
bucket (each orchestrator instance keeps the same index; acting on a record is a compare-and-set)."""

from __future__ import annotations

import asyncio
import contextlib

from nats.js.kv import KeyValue
from pydantic import ValidationError

from libs.common.records import RequestRecord


class InflightRequests:
    def __init__(self, kv: KeyValue, pipeline: str) -> None:
        self._kv = kv
        self._pipeline = pipeline
        self.records: dict[str, RequestRecord] = {}
        """Request id → its latest non-terminal record."""

    def __len__(self) -> int:
        return len(self.records)

    def forget(self, request_id: str) -> None:
        """Drop a request known to be terminal (its record may not have said so yet)."""
        self.records.pop(request_id, None)

    def bound_to(self, stage: int, replica: int) -> list[RequestRecord]:
        """Requests whose ``stage`` runs on ``replica`` and has not finished there."""
        return [rec for rec in self.records.values() if (stage, replica) in _bound(rec)]

    def busy(self) -> set[tuple[int, int]]:
        """(stage, replica) of every replica with a request bound to it and not finished there."""
        return {key for rec in self.records.values() for key in _bound(rec)}

    async def start(self) -> asyncio.Task[None]:
        """Watch the bucket; the task that keeps the index (the caller cancels it)."""
        watcher = await self._kv.watchall()
        return asyncio.create_task(self._watch(watcher), name="inflight-watch")

    async def _watch(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is None:
                    continue
                gone = entry.operation in ("DEL", "PURGE") or not entry.value
                try:
                    rec = None if gone else RequestRecord.model_validate_json(entry.value)
                except ValidationError:
                    continue
                if rec is None or (rec.pipeline == self._pipeline and rec.status.terminal):
                    self.records.pop(entry.key, None)
                elif rec.pipeline == self._pipeline:
                    self.records[entry.key] = rec
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def _bound(rec: RequestRecord) -> list[tuple[int, int]]:
    """(stage, replica) of each stage of ``rec`` not finished on its replica."""
    return [(s, r) for s, r in enumerate(rec.route) if s >= len(rec.stages) or rec.stages[s].done_ns is None]
