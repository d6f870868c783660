"""The engines run at a lower CPU priority than the control plane.

On a box with fewer cores than busy threads, an engine's model runner is always runnable; at the
same priority as the broker, the gateway, the orchestrator and the workers' event loops it takes its
full share, and they wait for a core: the broker was seen silent for 3.5 s at a load of 11 on two
cores (docs/reliability.md, "The broker went silent: CPU starvation"). A higher nice value gives
the scheduler's fair share to the control plane whenever both want a core, and costs the engines
nothing when the control plane is idle (most of the time: it handles a message in microseconds).

Linux keeps a nice value per thread, and a new thread or process inherits its creator's: raising
it on every thread of the engine's processes once they have started covers the threads they start
later. Raising one's own or a child's nice value needs no privilege.
"""

from __future__ import annotations

import logging
import os
import threading

import psutil

log = logging.getLogger(__name__)


def _raise_thread(tid: int, nice: int) -> bool:
    """Set thread ``tid``'s nice value to ``nice`` if it is lower now; whether it was raised."""
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (ProcessLookupError, PermissionError):  # gone meanwhile, or not ours
        return False


def lower_children(nice: int) -> int:
    """Raise every thread of this process's descendants (an ``llm`` worker's: its engine's
    processes) to ``nice``; the number of threads raised."""
    raised = 0
    for child in psutil.Process().children(recursive=True):
        try:
            threads = child.threads()
        except psutil.Error:
            continue
        raised += sum(_raise_thread(t.id, nice) for t in threads)
    log.info("engine processes at nice %d (%d threads)", nice, raised)
    return raised


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread (a codec worker's decoding thread) to ``nice``; a thread pool's
    ``initializer``."""
    _raise_thread(threading.get_native_id(), nice)
