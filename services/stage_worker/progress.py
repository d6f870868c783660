"""What a worker's engine is doing, for liveness from progress.

A handler counts its engine operations under way (``busy``) and the outputs they produce
(``outputs``); liveness answers and heartbeats carry both. The orchestrators move the requests of a
replica whose ``busy`` stays above 0 while ``outputs`` stays flat for ``stall_timeout_s``; the
worker itself (:class:`HungEngineWatch`) exits a while later so that it is started anew.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class EngineProgress:
    """Counters of one worker's engine, updated where the work happens (event loop only)."""

    busy: int = 0
    """Engine operations under way (generations, chunk decodes)."""
    outputs: int = 0
    """Outputs produced since start (engine outputs, decoded chunks); never decreases."""

    @contextmanager
    def working(self) -> Iterator[None]:
        """Around one engine operation, however it ends."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    def advanced(self) -> None:
        self.outputs += 1


HUNG_AFTER_STALLS = 2.0
"""A worker gives up on its engine after this many ``stall_timeout_s`` without progress: the
orchestrators have moved its requests after one."""


@dataclass
class HungEngineWatch:
    """Whether an engine is hung: flat ``outputs`` while it had work, for
    ``HUNG_AFTER_STALLS × stall_timeout_s`` of this process's running time.

    :meth:`observe` takes the counters and the seconds since its previous call (monotonic), at most
    ``max_step_s`` of them (a stopped process did not watch). Once flat with work for
    ``stall_timeout_s``, only new outputs clear the suspicion (its requests move and ``busy`` drops).
    """

    stall_timeout_s: float
    max_step_s: float
    flat_s: float = 0.0
    """Seconds of flat outputs counted so far."""
    suspect: bool = False
    _last: int = 0

    def observe(self, progress: EngineProgress, dt_s: float) -> None:
        if progress.outputs != self._last:
            self._last, self.flat_s, self.suspect = progress.outputs, 0.0, False
        elif progress.busy > 0 or self.suspect or self.flat_s >= self.stall_timeout_s:
            self.flat_s += min(dt_s, self.max_step_s)
        else:
            self.flat_s = 0.0

    def moved_away(self) -> None:
        """A request of this worker moved to another replica: after half a stall timeout flat, the
        orchestrators judged the engine stalled (their clock may run ahead): keep counting."""
        if self.flat_s >= self.stall_timeout_s / 2:
            self.suspect = True

    @property
    def hung(self) -> bool:
        return self.flat_s >= HUNG_AFTER_STALLS * self.stall_timeout_s
