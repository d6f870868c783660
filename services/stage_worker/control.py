"""The stage worker's answers to control messages (liveness probes, route notices, aborts); they
change its :class:`~services.stage_worker.request_table.RequestTable` only through its transitions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from libs.common.envelopes import MOVED, AbortNotice, ResumePoint, ResumeQuery, RouteNotice, decode_or_log
from libs.common.pipeline import PipelineConfig
from services.stage_worker.engine_health import EngineHealth
from services.stage_worker.handlers.base import StageHandler
from services.stage_worker.request_context import Identity, RequestContext
from services.stage_worker.request_table import Entry, RequestTable

log = logging.getLogger(__name__)


@dataclass
class ControlAnswers:
    """The control-message callbacks of one stage worker (subscribed in ``StageWorker.start``)."""

    me: Identity
    pipeline: PipelineConfig
    handler: StageHandler
    health: EngineHealth
    requests: RequestTable
    label: str
    records: KeyValue | None = None  # omni_requests, set once connected

    async def on_alive(self, msg: Msg) -> None:
        await msg.respond(self.health.liveness().encode())

    async def on_route(self, msg: Msg) -> None:
        """A move of the next stage: a :class:`ResumeQuery` holds the request's chunks (answered with
        the next ``seq``), a moved :class:`AbortNotice` sends them on to the new replica."""
        if (change := decode_or_log(RouteNotice, msg.data, "route notice", log, f"{self.label}: ")) is None:
            return
        if not self._routable(change):
            log.warning(
                "%s: dropped a route notice for stage %s replica %s", self.label, change.stage, change.replica
            )
            await msg.respond(ResumePoint(known=False).encode())  # not the next stage, or no such replica
            return
        if (entry := self.requests.route_while_queued(change.request_id, change)) is not None:
            first = min((d.task for d in entry.queued), key=lambda t: t.seq)  # it has sent nothing yet
            next_seq = await self.handler.first_chunk_seq(first, self.records)
            await msg.respond(ResumePoint(known=True, next_seq=next_seq).encode())
            return
        ctx = self.requests.running_ctx(change.request_id)
        if ctx is None or ctx.aborted:
            await msg.respond(ResumePoint(known=False).encode())
            return
        next_seq = 0
        if isinstance(change, ResumeQuery):
            next_seq = await ctx.hold()
        else:
            reroute(ctx, change)
            log.info(
                "%s: request %s: stage %d now on replica %d (attempt %d)",
                self.label,
                change.request_id,
                change.stage,
                change.replica,
                change.attempt,
            )
        await msg.respond(ResumePoint(known=True, next_seq=next_seq).encode())

    def _routable(self, change: RouteNotice) -> bool:
        """A move's notice that names this worker's next stage and one of its declared replicas."""
        stage, replica = change.stage, change.replica
        return (
            (isinstance(change, ResumeQuery) or change.reason == MOVED)
            and stage is not None
            and self.pipeline.upstream(stage) == self.me.stage
            and replica is not None
            and self.pipeline.declares(stage, replica)
        )

    async def on_abort(self, msg: Msg) -> None:
        """Stop a request, or (``moved``) the attempts of one of its stages it moved past."""
        if (notice := decode_or_log(AbortNotice, msg.data, "abort notice", log, f"{self.label}: ")) is None:
            return
        rid = notice.request_id
        if notice.reason != MOVED:
            _stop(self.requests.aborted(rid), notice.reason)
            return
        if notice.stage is None:
            return
        # the stage before this one is the thinker, whose new attempt sends its chunks anew
        up = self.pipeline.upstream(self.me.stage)
        restarts = up is not None and self.pipeline.takes_start(up) and notice.stage == self.me.stage - 1
        stop = self.requests.moved(rid, notice.stage, notice.attempt, self.me.stage, restarts)
        if restarts:
            log.info(
                "%s: request %s: stage %d moved to attempt %d; chunks of older attempts are stale here",
                self.label,
                rid,
                notice.stage,
                notice.attempt,
            )
        if stop is not None:
            log.info("%s: request %s moved to another replica; stopping it here", self.label, rid)
            self.health.hang_watch.moved_away()
            _stop(stop, notice.reason)


def _stop(entry: Entry | None, reason: str) -> None:
    """Abort a running request's handler (``reason`` stays on its context)."""
    if entry is not None and entry.ctx is not None and entry.run is not None:
        entry.ctx.abort(reason)
        entry.run.cancel()


def reroute(ctx: RequestContext, change: RouteNotice) -> None:
    """Apply a route notice (a move's hold or release) to a request that has not seen it."""
    if isinstance(change, ResumeQuery):
        ctx.hold_now()
    elif change.replica is not None and change.stage is not None:
        ctx.release(change.stage, change.replica, change.attempt, change.start_seq)
