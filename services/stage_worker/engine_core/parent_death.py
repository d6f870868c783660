"""An engine process dies with the process that started it.

vLLM's EngineCore is a child of the worker (its frontend) and has no way of noticing that the worker
is gone: after a ``kill -9`` of a worker it lives on as an orphan with its own child, the model
runner (measured: two orphans of 2.3 GB each left by two test runs). The model runner already
watches its parent (vLLM's death pipe), the EngineCore does not. The kernel can do it for every
engine process: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks it to kill this process when its parent
exits, however the parent ends.

Called by the vLLM general plugin (:mod:`~services.stage_worker.engine_core.plugin`) in every vLLM
process, where only a process started by Python's ``multiprocessing`` (the engine's) is linked, never
the worker itself; an EngineCore forked from its worker, which inherits the plugins as loaded, links
itself right after the fork (:mod:`services.stage_worker.engine_executor`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent exits (linux/prctl.h)."""


def link_to_parent() -> bool:
    """Have the kernel ``SIGKILL`` this process when its parent exits; exit now if the parent is
    already gone. False (nothing done) in a process that ``multiprocessing`` did not start, or off
    Linux."""
    parent = multiprocessing.parent_process()
    if parent is None or not hasattr(os, "sched_getaffinity"):
        return False
    return die_with_parent(parent.pid)


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel ``SIGKILL`` this process when its parent ``parent_pid`` exits; exit now if
    it is already gone. False where ``prctl`` refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:  # it died before the link was made
        os._exit(1)
    return True
