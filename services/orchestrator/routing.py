"""Choosing a replica per stage for a new request: the least loaded live replica. Load is what
each replica last reported in its heartbeat plus what this orchestrator has bound to it since;
ties go to the replica bound least recently."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from libs.common.bus import LIMITS
from libs.common.registry import LiveServices, ServiceKind, ServiceRecord


class NoLiveReplica(Exception):
    """A stage has no live replica; ``silent`` maps each replica that registered and expired
    to the seconds since its last heartbeat arrived."""

    def __init__(self, stage: int, silent: dict[int, float]) -> None:
        super().__init__(f"stage {stage} has no live replica")
        self.stage = stage
        self.silent = silent

    def why(self) -> str:
        """What the registry knows of the stage's replicas, for the log."""
        if not self.silent:
            return "none has registered"
        heard = ", ".join(f"replica {r} last heard {age:.1f} s ago" for r, age in sorted(self.silent.items()))
        return f"{heard} (a replica is dead {LIMITS.service_ttl_s:g} s after its last heartbeat)"


class ReplicaPicker:
    def __init__(
        self,
        services: LiveServices,
        dead: Callable[[ServiceRecord], bool] = lambda _: False,
        answering: Callable[[int, int], bool] = lambda _stage, _replica: False,
    ) -> None:
        """``dead(record)``: whether that incarnation of a replica has been judged dead;
        ``answering(stage, replica)``: whether the replica answered a liveness probe just now
        (:meth:`~services.orchestrator.liveness.ReplicaWatch.answering`)."""
        self._services = services
        self._dead = dead
        self._answering = answering
        self._since_beat: dict[tuple[int, int], int] = {}
        self._last_pick: dict[tuple[int, int], int] = {}
        self._clock = itertools.count()
        services.on_update(self._on_heartbeat)

    def _on_heartbeat(self, rec: ServiceRecord) -> None:
        if rec.service == ServiceKind.WORKER and rec.stage is not None and rec.replica is not None:
            self._since_beat[(rec.stage, rec.replica)] = 0

    def pick(self, stage: int) -> int:
        """Bind a replica of ``stage`` (raises :class:`NoLiveReplica`), passing over those judged
        dead; when no registration of the stage is live, one that answers its liveness probes."""
        live = [rec for rec in self._services.live(ServiceKind.WORKER, stage) if not self._dead(rec)]
        if not live:  # heartbeats are JetStream writes, which lag behind core NATS under load
            live = [
                rec
                for rec, _ in self._services.last_heard(ServiceKind.WORKER, stage)
                if rec.replica is not None and self._answering(stage, rec.replica) and not self._dead(rec)
            ]
        if not live:
            heard = self._services.last_heard(ServiceKind.WORKER, stage)
            raise NoLiveReplica(stage, {rec.replica: age for rec, age in heard if rec.replica is not None})

        def score(rec: ServiceRecord) -> tuple[int, int]:
            key = (stage, rec.replica)
            return (rec.load + self._since_beat.get(key, 0), self._last_pick.get(key, -1))

        best = min(live, key=score)
        key = (stage, best.replica)
        self._since_beat[key] = self._since_beat.get(key, 0) + 1
        self._last_pick[key] = next(self._clock)
        return best.replica
