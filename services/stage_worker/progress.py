"""What a worker's engine is doing, for liveness from progress: operations under way (``busy``) and
outputs produced; a replica busy with flat outputs for ``stall_timeout_s`` counts as stalled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class EngineProgress:
    """Counters of one worker's engine, updated where the work happens (event loop only)."""

    busy: int = 0  # engine operations under way (generations, chunk decodes)
    outputs: int = 0  # outputs produced since start; never decreases

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
"""A worker gives up on its engine after this many ``stall_timeout_s`` without progress."""


@dataclass
class HungEngineWatch:
    """Whether an engine is hung: flat ``outputs`` while it had work, for
    ``HUNG_AFTER_STALLS × stall_timeout_s``. :meth:`observe` takes the seconds since its previous
    call (monotonic), at most ``max_step_s``; once flat with work for ``stall_timeout_s``, only new
    outputs clear the suspicion."""

    stall_timeout_s: float
    max_step_s: float
    flat_s: float = 0.0
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
        """A request moved away: after half a stall timeout flat, keep counting without work."""
        if self.flat_s >= self.stall_timeout_s / 2:
            self.suspect = True

    @property
    def hung(self) -> bool:
        return self.flat_s >= HUNG_AFTER_STALLS * self.stall_timeout_s
