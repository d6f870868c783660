"""Whether a worker's engine lives and makes progress; a worker whose engine died or hangs answers
``engine_dead`` and exits soon after with a status that says which, to be started anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import psutil

from libs.common.envelopes import Liveness
from services.stage_worker.handlers.base import StageHandler
from services.stage_worker.progress import HungEngineWatch

log = logging.getLogger(__name__)

ENGINE_CHECK_PERIOD_S = 0.5
"""How often the worker checks that its engine lives and makes progress, seconds."""
ENGINE_DEAD_EXIT_AFTER_S = 1.5
"""A worker whose engine died exits this long after noticing, seconds."""
ENGINE_DEAD_EXIT_STATUS = 3
ENGINE_HUNG_EXIT_STATUS = 4


class EngineHealth:
    """The engine's health as one worker sees it (event loop only; clock: ``time.monotonic()``)."""

    def __init__(
        self, handler: StageHandler, stall_timeout_s: float, in_flight: Callable[[], int], label: str
    ) -> None:
        self._handler = handler
        self._in_flight = in_flight
        self._label = label
        self.hang_watch = HungEngineWatch(stall_timeout_s, max_step_s=2 * ENGINE_CHECK_PERIOD_S)
        self._dead_since: float | None = None  # engine found dead or hung (monotonic s)

    def liveness(self) -> Liveness:
        p = self._handler.progress
        return Liveness(
            engine_dead=self._dead_since is not None,
            in_flight=self._in_flight(),
            busy=p.busy,
            progress=p.outputs,
        )

    def engine_died(self) -> bool:
        """Whether the engine has died under this worker (the first time, the worker exits soon)."""
        if self._dead_since is None and self._handler.engine_dead():
            self._exit_soon("the engine died", ENGINE_DEAD_EXIT_STATUS)
        return self._dead_since is not None

    def _exit_soon(self, why: str, status: int) -> None:
        """Exit ``ENGINE_DEAD_EXIT_AFTER_S`` from now with ``status``, with the engine's processes."""
        self._dead_since = time.monotonic()
        log.critical(
            "%s: %s; exiting in %.1f s (exit status %d) so that this replica is started anew",
            self._label,
            why,
            ENGINE_DEAD_EXIT_AFTER_S,
            status,
        )
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_AFTER_S, _exit_with_children, status)

    async def watch(self) -> None:
        watch = self.hang_watch
        last = time.monotonic()
        while not self.engine_died():
            await asyncio.sleep(ENGINE_CHECK_PERIOD_S)
            now = time.monotonic()
            watch.observe(self._handler.progress, now - last)
            last = now
            if watch.hung:
                self._exit_soon(
                    f"the engine produced nothing for {watch.flat_s:.1f} s while it had work",
                    ENGINE_HUNG_EXIT_STATUS,
                )
                return


def _exit_with_children(status: int) -> None:
    """Kill this process's descendants (``SIGKILL`` ends a stopped one too), then exit."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(status)
