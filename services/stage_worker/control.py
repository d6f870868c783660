"""The stage worker's answers to control messages: liveness probes, replays a gateway asks for,
the orchestrator's route changes and aborts (core NATS requests on the worker's own subjects).

:class:`ControlAnswers` is a mixin of :class:`services.stage_worker.worker.StageWorker`: it reads
the worker's request table, backlog and attempt marks and changes nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    Replay,
    ReplayAsk,
    RouteChange,
    RouteHeld,
    decode_or_log,
)
from libs.common.pipeline import PipelineConfig
from libs.common.settings import WorkerSettings
from services.stage_worker.attempt_marks import AttemptMarks
from services.stage_worker.engine_health import EngineHealth
from services.stage_worker.handlers.base import StageHandler
from services.stage_worker.inbox import Delivery
from services.stage_worker.request_context import Identity, RequestContext
from services.stage_worker.sent_events import SentEvents

log = logging.getLogger(__name__)


class ControlAnswers:
    """The control-message callbacks of a stage worker (subscribed in ``StageWorker.start``)."""

    settings: WorkerSettings
    pipeline: PipelineConfig
    me: Identity
    handler: StageHandler
    health: EngineHealth
    sent: SentEvents
    active: dict[str, tuple[RequestContext, asyncio.Task[None]]]
    _backlog: deque[Delivery]
    _early_routes: dict[str, RouteChange]
    _records: KeyValue | None
    _closed: AttemptMarks
    _fences: AttemptMarks
    _moving: AttemptMarks
    label: str

    async def _on_alive(self, msg: Msg) -> None:
        """Answer a liveness probe: the answer itself says this event loop runs; its fields say
        whether the engine lives and makes progress (services/orchestrator/liveness.py)."""
        await msg.respond(self.health.liveness().encode())

    async def _on_replay(self, msg: Msg) -> None:
        """A gateway lost some of the client events this worker sent: send them again."""
        if (ask := decode_or_log(ReplayAsk, msg.data, "replay request", log, f"{self.label}: ")) is None:
            return
        events = self.sent.get(ask.request_id, ask.attempt, ask.from_seq, ask.to_seq)
        await msg.respond(Replay(known=events is not None, events=events or []).encode())
        log.info(
            "%s: request %s: %s client events %d-%d again",
            self.label,
            ask.request_id,
            f"sent {len(events)}" if events is not None else "no longer holds",
            ask.from_seq,
            ask.to_seq - 1,
        )

    async def _on_route(self, msg: Msg) -> None:
        """The orchestrator moves the next stage of one of this worker's requests: hold its
        chunks, then send them to the new replica (services/orchestrator/orchestrator.py)."""
        if (change := decode_or_log(RouteChange, msg.data, "route change", log, f"{self.label}: ")) is None:
            return
        if change.stage != self.settings.stage + 1 or not self.pipeline.declares(
            change.stage, change.replica
        ):
            log.warning(
                "%s: dropped a route change to stage %d replica %d", self.label, change.stage, change.replica
            )
            await msg.respond(RouteHeld(held=False).encode())  # not the next stage, or no such replica
            return
        entry = self.active.get(change.request_id)
        waiting = [d.task for d in self._backlog if d.task.request_id == change.request_id]
        if entry is None and waiting:
            self._early_routes[change.request_id] = change  # it has sent nothing yet
            first = min(waiting, key=lambda t: t.seq)
            await msg.respond(
                RouteHeld(
                    held=True, next_seq=await self.handler.first_chunk_seq(first, self._records)
                ).encode()
            )
            return
        if entry is None or entry[0].aborted:
            await msg.respond(RouteHeld(held=False).encode())
            return
        ctx = entry[0]
        if change.action == "hold":
            next_seq = await ctx.hold()
        else:
            reroute(ctx, change)
            next_seq = -1
            log.info(
                "%s: request %s: stage %d now on replica %d (attempt %d)",
                self.label,
                change.request_id,
                change.stage,
                change.replica,
                change.attempt,
            )
        await msg.respond(RouteHeld(held=True, next_seq=max(next_seq, 0)).encode())

    async def _on_abort(self, msg: Msg) -> None:
        if (notice := decode_or_log(AbortNotice, msg.data, "abort notice", log, f"{self.label}: ")) is None:
            return
        entry = self.active.get(notice.request_id)
        if notice.reason == MOVED:
            # The request runs on as ``notice.attempt`` of ``notice.stage`` elsewhere: stop an
            # older attempt of it here (a replica that resumed after a stall, or that the
            # request was queued on), and drop its input if it arrives or waits in the backlog.
            # Stage 0 moved: its older attempts' chunks are stale here.
            if notice.stage == 0 and self.me.stage == 1:
                self._fences.raise_to(notice.request_id, notice.attempt)
                log.info(
                    "%s: request %s: stage 0 moved to attempt %d; chunks of older attempts are stale here",
                    self.label,
                    notice.request_id,
                    notice.attempt,
                )
            if notice.stage != self.me.stage:
                return
            self._closed.raise_to(notice.request_id, notice.attempt - 1)
            self._moving.raise_to(notice.request_id, notice.attempt - 1)
            if entry is not None and entry[0].attempt < notice.attempt:
                log.info(
                    "%s: request %s moved to another replica; stopping it here", self.label, notice.request_id
                )
                self.health.hang_watch.moved_away()
                entry[0].abort(notice.reason)
                entry[1].cancel()
            return
        self._closed.raise_to(notice.request_id, entry[0].attempt if entry else 1 << 30)
        if entry is not None:
            entry[0].abort(notice.reason)
            entry[1].cancel()


def reroute(ctx: RequestContext, change: RouteChange) -> None:
    """Apply a route change to a request that has not seen it (one that was in the backlog
    takes the latest: held, or released to the new replica)."""
    if change.action == "hold":
        ctx.hold_now()
    else:
        ctx.release(change.stage, change.replica, change.attempt, change.start_seq)
