"""An engine process dies with the process that started it.

vLLM's EngineCore has no way of noticing that its worker is gone, and would live on as an orphan
after a ``kill -9`` of the worker. ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to kill it
when its parent exits. Called by the vLLM plugin (:mod:`.plugin`) in every vLLM process (only one
that ``multiprocessing`` started is linked), and right after the fork of an EngineCore forked from
its worker (:mod:`services.stage_worker.engine_executor`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent exits (linux/prctl.h)."""


def link_to_parent() -> bool:
    """:func:`die_with_parent` in a process that ``multiprocessing`` started, on Linux; else False."""
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
