"""How a service process runs: its event loop, and its heap once it has started."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")
log = logging.getLogger(__name__)


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a uvloop event loop (what uvicorn gives the gateway)."""
    return uvloop.run(main)


def freeze_startup_heap() -> None:
    """Move everything allocated so far out of the garbage collector's sight (as vLLM does)."""
    gc.collect()
    gc.freeze()


def yield_on_wakeup(enabled: bool) -> bool:
    """Schedule this process ``SCHED_BATCH`` (when ``enabled``): it never preempts the running
    task on wake-up (so a publisher woken by its JetStream ack does not preempt the broker before
    the consumer has the message). Call it before any thread starts; returns whether in force."""
    if not enabled:
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:  # not Linux, or a sandbox that forbids it
        log.warning("could not switch to SCHED_BATCH (%s); scheduling unchanged", e)
        return False
    return True


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: never started) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
