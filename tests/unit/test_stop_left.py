"""``tests.procs.stop_left`` (what ``tests/conftest.py`` calls at the end of each module and of
the session) stops every process still running, one a fault test left stopped too, and leaves
alone what has ended."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.procs import ServiceProcess, stop_left


def _sleeper(tmp_path: Path, name: str) -> ServiceProcess:
    """A process started as ``ServiceProcess.start`` starts one (a session of its own)."""
    p = ServiceProcess([name], {}, tmp_path / f"{name}.log")
    p.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    return p


def test_running_and_stopped_processes_are_stopped(tmp_path: Path) -> None:
    running, stopped, ended = (_sleeper(tmp_path, n) for n in ("running", "stopped", "ended"))
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    ended.proc.kill()
    ended.proc.wait()
    began = time.monotonic()
    stop_left([running, stopped, ended])
    assert running.proc.poll() == -signal.SIGTERM and stopped.proc.poll() == -signal.SIGTERM
    assert time.monotonic() - began < 5, "the stopped one waited out the SIGKILL timeout"
    assert ended.proc.returncode == -signal.SIGKILL
