"""The engines run at a lower CPU priority than the control plane (docs/reliability.md, "The
engines yield the CPU"). Nice values are per thread and inherited; raising them needs no privilege,
lowering them would, so the worker raises its engine's threads, not its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import psutil

log = logging.getLogger(__name__)

STARTUP_POLL_S = 0.1
"""How often the starting engine's new processes and threads are looked for, seconds."""


def _raise_thread(tid: int, nice: int) -> bool:
    """Set thread ``tid``'s nice value to ``nice`` if it is lower now; whether it was raised."""
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (ProcessLookupError, PermissionError):  # gone meanwhile, or not ours
        return False


def _lower_descendants(nice: int) -> int:
    """Raise every thread of this process's descendants to ``nice``; the number raised."""
    raised = 0
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:  # one ended while the tree was read: the next pass sees the rest
        return 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            raised += sum(_raise_thread(t.id, nice) for t in child.threads())
    return raised


@contextlib.contextmanager
def lowered_children(nice: int, every_s: float = STARTUP_POLL_S) -> Iterator[None]:
    """Around an engine's start: raise its threads to ``nice`` every ``every_s`` s and at the end."""
    stop = threading.Event()
    raised = 0

    def watch() -> None:
        nonlocal raised
        while not stop.wait(every_s):
            raised += _lower_descendants(nice)

    watcher = threading.Thread(target=watch, name="engine-nice", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        raised += _lower_descendants(nice)
        log.info("engine processes at nice %d (%d threads raised)", nice, raised)


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread to ``nice`` (a thread pool's ``initializer``)."""
    _raise_thread(threading.get_native_id(), nice)
