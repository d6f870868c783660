"""The engines run at a lower CPU priority than the control plane.

On a box with fewer cores than busy threads, an engine's model runner is always runnable; at the
same priority as the broker, the gateway, the orchestrator and the workers' event loops it takes its
full share, and they wait for a core: the broker was seen silent for 3.5 s at a load of 11 on two
cores (docs/reliability.md, "The engines yield the CPU"). A higher nice value gives
the scheduler's fair share to the control plane whenever both want a core, and costs the engines
nothing when the control plane is idle (most of the time: it handles a message in microseconds).

Linux keeps a nice value per thread, and a new thread or process inherits its creator's: raising
it on every thread of the engine's processes from the moment they appear (polled while the engine
starts) covers the threads they start later. Raising one's own or a child's nice value needs no
privilege; lowering it again would (``CAP_SYS_NICE``, which containers lack), which is why the
worker does not simply raise its own before it starts the engine.
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
"""How often the engine's new processes and threads are looked for while it starts, seconds."""


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
        try:
            threads = child.threads()
        except psutil.Error:
            continue
        raised += sum(_raise_thread(t.id, nice) for t in threads)
    return raised


@contextlib.contextmanager
def lowered_children(nice: int, every_s: float = STARTUP_POLL_S) -> Iterator[None]:
    """Around an engine's start (an ``llm`` worker's: vLLM spawns its processes, which load the
    model, profile and warm up for seconds to minutes, the heaviest work they do): every
    ``every_s`` seconds, and once more at the end, raise every thread of this process's
    descendants to ``nice``. A replacement engine that started at nice 0 under load starved the
    broker and let another service's heartbeat expire."""
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
    """Raise the calling thread (a codec worker's decoding thread) to ``nice``; a thread pool's
    ``initializer``."""
    _raise_thread(threading.get_native_id(), nice)
