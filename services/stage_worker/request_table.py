"""The requests one stage worker knows of: one entry per request, its phase one of :class:`Phase`,
and every change of phase in this module.

| phase | the request here | an input of it that arrives |
| --- | --- | --- |
| ``EXPECTED`` | not seen yet; a notice about it came first (an abort, or the thinker's move) | judged by the marks below |
| ``QUEUED`` | its inputs wait for room (``max_inflight`` requests run), started in arrival order | joins them |
| ``RUNNING`` | its handler runs here | goes to its inbox |
| ``ENDED`` | its attempt ended here: done, failed or aborted | of that attempt or older: acknowledged and dropped |
| ``MOVED_AWAY`` | its attempt moved off this replica, or its engine died under it | of that attempt or older: left unacknowledged, the move sends it on from the stream |

An entry also keeps three attempt numbers that only grow (the latest that ended here, the latest
that moved away, and at the stage after the thinker the thinker's current one); :meth:`RequestTable.judge`
decides from them alone. Clock: ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from libs.common.envelopes import RouteNotice, StageTask
from services.stage_worker.inbox import Delivery
from services.stage_worker.request_context import RequestContext

KEEP_S = 600.0
"""Past :data:`MAX_ENTRIES`, entries not running are forgotten this long after their last change, s."""
MAX_ENTRIES = 10_000
EVERY_ATTEMPT = 1 << 30  # above any real attempt: an abort of a request not seen yet drops all of it


class Phase(StrEnum):
    EXPECTED = "expected"
    QUEUED = "queued"
    RUNNING = "running"
    ENDED = "ended"
    MOVED_AWAY = "moved_away"


class Verdict(StrEnum):
    """What to do with a delivered input (:meth:`RequestTable.judge`)."""

    TAKE = "take"  # start its request with it, or hand it to the request queued or running here
    DROP = "drop"  # acknowledge and drop it: its attempt ended here
    STALE = "stale"  # acknowledge, drop and count it: from a stage-0 attempt the request moved past
    LEAVE = "leave"  # leave it unacknowledged: its attempt moved off this replica, the move sends it on


@dataclass
class Entry:
    """One request at this worker."""

    phase: Phase
    ended: int = 0  # the latest attempt that ended here
    moved_away: int = 0  # the latest attempt that moved off this replica
    upstream: int = 0  # the thinker's current attempt, at the stage after it
    queued: list[Delivery] = field(default_factory=list)  # QUEUED: its inputs, in arrival order
    route: RouteNotice | None = None  # QUEUED: the latest hold or release, applied when it starts
    ctx: RequestContext | None = None  # RUNNING: its context and the task that runs its handler
    run: asyncio.Task[None] | None = None
    changed_s: float = field(default_factory=time.monotonic)


class RequestTable:
    """Request id → :class:`Entry`; the queued ones also in arrival order."""

    def __init__(self, keep_s: float = KEEP_S, max_entries: int = MAX_ENTRIES) -> None:
        self._entries: dict[str, Entry] = {}
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._running: set[str] = set()
        self._keep_s, self._max = keep_s, max_entries

    def get(self, request_id: str) -> Entry | None:
        return self._entries.get(request_id)

    def running_ctx(self, request_id: str) -> RequestContext | None:
        entry = self._entries.get(request_id)
        return entry.ctx if entry is not None and entry.phase == Phase.RUNNING else None

    def running(self) -> list[Entry]:
        return [self._entries[rid] for rid in self._running]

    @property
    def running_count(self) -> int:
        return len(self._running)

    def queued_inputs(self) -> list[Delivery]:
        """Every input that waits for room, oldest request first."""
        return [d for rid in self._queue for d in self._entries[rid].queued]

    def judge(self, task: StageTask) -> Verdict:
        """The verdict on an input (one moved here from a dead replica is never stale)."""
        entry = self._entries.get(task.request_id)
        if entry is None:
            return Verdict.TAKE
        if task.attempt <= entry.moved_away:
            return Verdict.LEAVE
        if task.attempt <= entry.ended:
            return Verdict.DROP
        if not task.moved and task.from_attempt < entry.upstream:
            return Verdict.STALE
        return Verdict.TAKE

    def queue(self, d: Delivery) -> None:
        """→ ``QUEUED``: ``d`` waits for room, behind the requests queued before."""
        entry = self._entry(d.task.request_id)
        entry.phase = Phase.QUEUED
        entry.queued.append(d)
        self._queue[d.task.request_id] = None

    def route_while_queued(self, request_id: str, change: RouteNotice) -> Entry | None:
        """Keep a hold or release for a queued request: its entry; None when it is not queued here."""
        entry = self._entries.get(request_id)
        if entry is None or entry.phase != Phase.QUEUED:
            return None
        entry.route = change
        return entry

    def next_queued(self) -> tuple[list[Delivery], RouteNotice | None] | None:
        """The oldest queued request's inputs and route notice, taken out for the caller to start."""
        if not self._queue:
            return None
        rid, _ = self._queue.popitem(last=False)
        entry = self._entries[rid]
        queued, route = entry.queued, entry.route
        entry.queued, entry.route = [], None
        entry.phase = _settled(entry)  # until one of its inputs starts it
        return queued, route

    def start(self, ctx: RequestContext, run: asyncio.Task[None]) -> None:
        """→ ``RUNNING``."""
        entry = self._entry(ctx.request_id)
        entry.phase, entry.ctx, entry.run = Phase.RUNNING, ctx, run
        self._queue.pop(ctx.request_id, None)
        self._running.add(ctx.request_id)

    def end(self, ctx: RequestContext, moved_away: bool) -> None:
        """``RUNNING`` → ``ENDED``, or ``MOVED_AWAY`` when its inputs move with the request."""
        entry = self._entry(ctx.request_id)
        entry.ended = max(entry.ended, ctx.attempt)
        if moved_away:
            entry.moved_away = max(entry.moved_away, ctx.attempt)
        if entry.ctx is ctx:
            entry.phase = Phase.MOVED_AWAY if moved_away else Phase.ENDED
            entry.ctx = entry.run = None
            self._running.discard(ctx.request_id)
        self._forget_old()

    def moved(
        self, request_id: str, stage: int, attempt: int, my_stage: int, upstream_restarts: bool
    ) -> Entry | None:
        """The request moved ``stage`` to ``attempt``: older attempts here end and move away (with
        ``upstream_restarts``, chunks of older attempts are stale). The running entry to stop."""
        entry = self._entry(request_id)
        if upstream_restarts:
            entry.upstream = max(entry.upstream, attempt)
        if stage != my_stage:
            return None
        entry.ended = max(entry.ended, attempt - 1)
        entry.moved_away = max(entry.moved_away, attempt - 1)
        if entry.phase == Phase.RUNNING and entry.ctx is not None:
            return entry if entry.ctx.attempt < attempt else None
        if entry.phase != Phase.QUEUED:  # queued inputs of the old attempt are judged when taken out
            entry.phase = _settled(entry)
        return None

    def aborted(self, request_id: str) -> Entry | None:
        """The request was aborted everywhere: its attempt here ends. The running entry to stop."""
        entry = self._entry(request_id)
        running = entry.phase == Phase.RUNNING and entry.ctx is not None
        entry.ended = max(entry.ended, entry.ctx.attempt if running else EVERY_ATTEMPT)
        if not running and entry.phase != Phase.QUEUED:
            entry.phase = _settled(entry)
        return entry if running else None

    def _entry(self, request_id: str) -> Entry:
        entry = self._entries.setdefault(request_id, Entry(Phase.EXPECTED))
        entry.changed_s = time.monotonic()
        return entry

    def _forget_old(self) -> None:
        if len(self._entries) <= self._max:
            return
        now = time.monotonic()
        self._entries = {
            rid: e
            for rid, e in self._entries.items()
            if e.phase in (Phase.QUEUED, Phase.RUNNING) or now - e.changed_s < self._keep_s
        }


def _settled(entry: Entry) -> Phase:
    if entry.moved_away and entry.moved_away >= entry.ended:
        return Phase.MOVED_AWAY
    return Phase.ENDED if entry.ended else Phase.EXPECTED
