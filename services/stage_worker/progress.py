"""What a worker's engine is doing, for liveness from progress (docs/contract.md, "Reliability": a
replica holding work without progressing counts as dead).

A handler counts its engine operations under way (``busy``) and the outputs they produce
(``outputs``); the worker answers its liveness probe and writes its heartbeat with both
(:class:`~libs.common.envelopes.Liveness`). The orchestrators judge a replica whose ``busy`` stays
above 0 while ``outputs`` stays flat for the stage's ``stall_timeout_s`` stalled and move its
requests; the worker itself, with :class:`HungEngineWatch`, gives up on such an engine a while
later and exits so that it is started anew.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class EngineProgress:
    """Counters of one worker's engine, updated where the work happens (event loop only)."""

    busy: int = 0
    """Engine operations under way: generations waiting for their next engine output, chunks
    being decoded."""
    outputs: int = 0
    """Outputs produced since start (one per engine output of a generation, one per decoded
    chunk); never decreases."""

    @contextmanager
    def working(self) -> Iterator[None]:
        """Around one engine operation (a generation, a decode), however it ends."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    def advanced(self) -> None:
        """The engine produced one output."""
        self.outputs += 1


HUNG_AFTER_STALLS = 2.0
"""A worker gives up on its engine after this many ``stall_timeout_s`` without progress: the
orchestrators have moved its requests after one."""


@dataclass
class HungEngineWatch:
    """Whether an engine is hung: flat ``outputs`` while it had work, for
    ``HUNG_AFTER_STALLS × stall_timeout_s`` of this process's running time.

    :meth:`observe` is called periodically with the counters and the seconds since the previous
    call (``time.monotonic()``). A gap longer than ``max_step_s`` counts as ``max_step_s``: a whole
    process that was stopped (``SIGSTOP``) did not watch its engine meanwhile. Once the engine has
    been flat with work for ``stall_timeout_s`` its requests are moved away and ``busy`` may drop to
    0; from then on only new outputs clear the suspicion.
    """

    stall_timeout_s: float
    max_step_s: float
    flat_s: float = 0.0
    """Seconds of flat outputs counted so far."""
    suspect: bool = False
    """Requests were moved away while the engine was flat with work: only new outputs clear it."""
    _last: int = 0

    def observe(self, progress: EngineProgress, dt_s: float) -> None:
        if progress.outputs != self._last:
            self._last, self.flat_s, self.suspect = progress.outputs, 0.0, False
        elif progress.busy > 0 or self.suspect or self.flat_s >= self.stall_timeout_s:
            self.flat_s += min(dt_s, self.max_step_s)
        else:
            self.flat_s = 0.0

    def moved_away(self) -> None:
        """A request of this worker was moved to another replica. If the engine had been flat
        with work for half a stall timeout, the orchestrators judged it stalled (their clock may
        run ahead of this one by a probe period): keep counting though it now has no work."""
        if self.flat_s >= self.stall_timeout_s / 2:
            self.suspect = True

    @property
    def hung(self) -> bool:
        return self.flat_s >= HUNG_AFTER_STALLS * self.stall_timeout_s
