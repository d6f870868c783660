"""Service registry in the ``omni_services`` KV bucket (JSON values): heartbeats and the
live-service view. Readers judge an entry's age by their own monotonic clock (time since the
update was received), never by comparing wall clocks across hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from enum import StrEnum

from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from libs.common.bus import LIMITS
from libs.common.bus_trust import Rejected, metrics_url_problem
from libs.common.envelopes import Liveness
from libs.common.pipeline import PipelineConfig
from libs.common.runtime import cancel_and_wait

log = logging.getLogger(__name__)

WATCH_SILENCE_S = 2 * LIMITS.heartbeat_s
"""A registry watch silent this long is cut off from the bucket, seconds (:meth:`LiveServices.live`)."""
MIN_BEAT_GAP_S = 0.25
"""Least time between two beats, seconds (:meth:`Heartbeat.load_dropped`)."""
LATE_BEATS = 2
"""A write stored this many heartbeat periods after the one before it is logged as late."""
MAX_LOGGED_KEYS = 10_000
"""Rejected keys remembered so that each is logged once (past this many, forgotten)."""


class ServiceKind(StrEnum):
    GATEWAY = "gateway"
    ORCHESTRATOR = "orchestrator"
    WORKER = "worker"


class ServiceRecord(BaseModel):
    """One live service instance (the value stored under :attr:`key`)."""

    service: ServiceKind
    pipeline: str
    instance: str
    stage: int | None = None
    stage_name: str | None = None
    replica: int | None = None
    metrics_url: str = ""
    load: int = 0
    """Requests in flight in this instance right now."""
    busy: int = 0
    """Workers: engine operations under way at the last heartbeat (:class:`Liveness`)."""
    progress: int = 0
    """Workers: outputs their engine has produced since it started (:class:`Liveness`)."""
    version: str = ""
    started_ns: int = 0
    heartbeat_ns: int = 0
    """Wall clock of the writer at the last heartbeat (informational)."""

    @property
    def key(self) -> str:
        """``worker.<pipeline>.<stage>.<replica>`` or ``<service>.<pipeline>.<instance>``."""
        if self.service == ServiceKind.WORKER:
            return f"worker.{self.pipeline}.{self.stage}.{self.replica}"
        return f"{self.service.value}.{self.pipeline}.{self.instance}"


def record_problem(key: str, rec: ServiceRecord, pipeline: PipelineConfig | None) -> str | None:
    """Why the record stored under ``key`` must not be used (None: it may): its fields must give
    back its key, a worker of ``pipeline`` must name a declared stage (by its name) and replica,
    and a metrics URL must pass :func:`metrics_url_problem`."""
    if rec.key != key:
        return f"its fields name {rec.key}"
    if rec.service == ServiceKind.WORKER and pipeline is not None and rec.pipeline == pipeline.name:
        stage, replica = rec.stage, rec.replica
        if stage is None or replica is None or not 0 <= stage < len(pipeline.stages):
            return f"stage {stage} is not declared"
        declared = pipeline.stages[stage]
        if not 0 <= replica < declared.replicas:
            return f"stage {stage} declares {declared.replicas} replica(s), not replica {replica}"
        if rec.stage_name is not None and rec.stage_name != declared.name:
            return f"stage {stage} is {declared.name}, not {rec.stage_name}"
    if rec.metrics_url and (why := metrics_url_problem(rec.metrics_url)) is not None:
        return f"metrics URL: {why}"
    return None


class Heartbeat:
    """Keeps a :class:`ServiceRecord` alive in the registry (``load``, ``liveness`` read per beat),
    writing it every ``period_s`` seconds."""

    def __init__(
        self,
        kv: KeyValue,
        record: ServiceRecord,
        load: Callable[[], int],
        liveness: Callable[[], Liveness] | None = None,
        period_s: float = LIMITS.heartbeat_s,
    ) -> None:
        self._period_s = period_s
        self._kv = kv
        self._record = record
        self._load = load
        self._liveness = liveness
        self._task: asyncio.Task[None] | None = None
        self._early = asyncio.Event()
        self._stored_s: float | None = None
        """When the last write was acknowledged (``time.monotonic()``)."""

    async def beat(self) -> None:
        """Write the record now, waiting at most one period for the acknowledgement."""
        self._record.load = self._load()
        if self._liveness is not None:
            now = self._liveness()
            self._record.busy, self._record.progress = now.busy, now.progress
        self._record.heartbeat_ns = time.time_ns()
        async with asyncio.timeout(self._period_s):
            await self._kv.put(self._record.key, self._record.model_dump_json().encode())
        stored, before = time.monotonic(), self._stored_s
        self._stored_s = stored
        if before is not None and stored - before > LATE_BEATS * self._period_s:
            log.warning(
                "heartbeat of %s stored %.1f s after the one before (TTL %.0f s): readers may have counted it dead",
                self._record.key,
                stored - before,
                LIMITS.service_ttl_s,
            )

    def load_dropped(self) -> None:
        """Call when the load went down: once it is half or less of what the registry shows, and
        2 or more below, the record is written early (within ``MIN_BEAT_GAP_S``)."""
        shown, now = self._record.load, self._load()
        if shown - now >= 2 and 2 * now <= shown:
            self._early.set()

    async def start(self) -> None:
        if not self._record.started_ns:
            self._record.started_ns = time.time_ns()
        await self.beat()
        self._task = asyncio.create_task(self._run(), name=f"heartbeat:{self._record.key}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        while True:
            # Due a period after the last beat began (an absolute deadline): after a stall it is
            # written the moment this process runs again.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(max(began + self._period_s, loop.time() + MIN_BEAT_GAP_S)):
                    await asyncio.sleep(MIN_BEAT_GAP_S)
                    await self._early.wait()
            self._early.clear()
            began = loop.time()
            try:
                await self.beat()
            except Exception as e:  # broker down: keep trying, the entry expires meanwhile
                log.warning("heartbeat failed: %s", type(e).__name__ if isinstance(e, TimeoutError) else e)

    async def stop(self) -> None:
        """Stop beating and remove the entry (a clean shutdown disappears at once)."""
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await self._kv.delete(self._record.key)


class LiveServices:
    """A watched, in-memory view of one pipeline's part of the registry (every pipeline's when
    ``pipeline`` is None). An update that fails :func:`record_problem` (against ``config``) removes
    what its key held, is logged once per key and told to ``on_rejected(reason, key)``."""

    def __init__(
        self,
        kv: KeyValue,
        pipeline: str | None,
        ttl_s: float = LIMITS.service_ttl_s,
        *,
        config: PipelineConfig | None = None,
        on_rejected: Callable[[Rejected, str], None] | None = None,
    ) -> None:
        self._kv = kv
        self._pipeline = pipeline
        self._ttl_s = ttl_s
        self._config = config
        self._on_rejected = on_rejected
        self._logged: set[str] = set()
        """Keys whose rejection has been logged."""
        self._entries: dict[str, tuple[ServiceRecord, float]] = {}
        self._last_update = time.monotonic()
        """When the watch last delivered anything (``time.monotonic()``)."""
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[ServiceRecord], None]] = []
        self.ready = asyncio.Event()

    def on_update(self, fn: Callable[[ServiceRecord], None]) -> None:
        self._listeners.append(fn)

    async def start(self) -> None:
        watcher = await self._kv.watch(f"*.{self._pipeline}.>" if self._pipeline else ">")
        self._task = asyncio.create_task(self._run(watcher), name="registry-watch")

    async def _run(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is None:
                    self.ready.set()
                    continue
                self._resume_clock(time.monotonic())
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    self._entries.pop(entry.key, None)
                    continue
                rec = self.accept(entry.key, entry.value)
                if rec is None:
                    continue
                self._entries[entry.key] = (rec, time.monotonic())
                for fn in self._listeners:
                    fn(rec)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _resume_clock(self, now: float) -> None:
        """The watch delivered at ``now``: after a silence past :data:`WATCH_SILENCE_S`, every
        entry's age goes on from where :meth:`live` froze it, not from the silence's end."""
        if (frozen_s := now - self._last_update - WATCH_SILENCE_S) > 0:
            self._entries = {k: (rec, seen + frozen_s) for k, (rec, seen) in self._entries.items()}
        self._last_update = now

    def accept(self, key: str, value: bytes) -> ServiceRecord | None:
        """The record of an update to ``key``, or None (then what ``key`` held is dropped too)."""
        try:
            rec: ServiceRecord | None = ServiceRecord.model_validate_json(value)
            why = record_problem(key, rec, self._config)
        except ValidationError as e:
            rec, why = None, f"malformed ({e.errors()[0]['msg']})"
        if why is None:
            self._logged.discard(key)
            return rec
        self._entries.pop(key, None)
        if key not in self._logged:
            if len(self._logged) >= MAX_LOGGED_KEYS:
                self._logged.clear()
            self._logged.add(key)
            log.warning("ignoring registry entry %s: %s", key, why)
        if self._on_rejected is not None:
            self._on_rejected(Rejected.BAD_RECORD, key)
        return None

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def last_heard(self, service: ServiceKind, stage: int | None = None) -> list[tuple[ServiceRecord, float]]:
        """Every record of ``service`` (and ``stage``), live or expired, with its age in seconds."""
        now = time.monotonic()
        return [
            (rec, now - seen)
            for rec, seen in self._entries.values()
            if rec.service == service and (stage is None or rec.stage == stage)
        ]

    def live(self, service: ServiceKind | None = None, stage: int | None = None) -> list[ServiceRecord]:
        """Records updated within the TTL, filtered by service kind and stage. Age stops counting
        while the watch is silent beyond :data:`WATCH_SILENCE_S` (the bucket is unreachable, not
        every service dead)."""
        now = min(time.monotonic(), self._last_update + WATCH_SILENCE_S)
        return [
            rec
            for rec, seen in self._entries.values()
            if now - seen <= self._ttl_s
            and (service is None or rec.service == service)
            and (stage is None or rec.stage == stage)
        ]
