"""The engine's processes are raised to the engine's nice value while it starts, and the worker's
own thread is left alone (services/stage_worker/engine_priority.py). Real child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from libs.stack.processes import wait_for
from services.stage_worker.engine_priority import lowered_children

SLEEPER = [
    sys.executable,
    "-c",
    "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)",
]


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _nices(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t) for t in _threads(pid)}


def test_a_process_started_inside_runs_at_the_nice_value_while_the_body_still_runs() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    child = None
    try:
        with lowered_children(own + 7, every_s=0.02):
            child = subprocess.Popen(SLEEPER)
            wait_for(
                lambda: len(_threads(child.pid)) == 2 and _nices(child.pid) == {own + 7},
                f"both threads of the child at nice {own + 7}",
                5,
                every_s=0.01,
            )
        assert os.getpriority(os.PRIO_PROCESS, 0) == own, "the worker's own thread was changed"
    finally:
        if child is not None:
            child.kill()
            child.wait()


def test_a_thread_already_lower_is_left_as_it_is() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    child = subprocess.Popen(["nice", "-n", "12", *SLEEPER])  # nice adds to its own value
    try:
        wait_for(
            lambda: len(_threads(child.pid)) >= 2 and _nices(child.pid) == {own + 12},
            f"both threads of the child at nice {own + 12}",
            5,
            every_s=0.01,
        )
        with lowered_children(own + 7, every_s=0.02):
            time.sleep(0.1)
        assert _nices(child.pid) == {own + 12}
    finally:
        child.kill()
        child.wait()
