"""How ``omnirelay up`` restarts a process that died: back-off and how the end is reported."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from cli.launcher import RESTART_MAX_DELAY_S, Stack, exit_status, restart_delay


def _ppid(pid: int) -> int | None:
    """The parent of a live ``pid``; None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def test_back_off_doubles_from_half_a_second_and_is_capped() -> None:
    assert [restart_delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert restart_delay(50) == RESTART_MAX_DELAY_S


def test_exit_status_names_the_signal() -> None:
    assert exit_status(0) == "exit 0"
    assert exit_status(3) == "exit 3"
    assert exit_status(-signal.SIGKILL) == "signal 9 (SIGKILL)"
    assert exit_status(-signal.SIGSEGV) == "signal 11 (SIGSEGV)"


async def test_a_supervised_process_that_dies_is_started_again_with_its_command(capfd) -> None:
    """A real child killed with SIGKILL: gone, then a new process with the same command. Like a
    worker, whose vLLM engine processes outlive it and hold its stdout, it leaves a grandchild
    behind that keeps the pipe open; the restart must not wait for that pipe, and the grandchild
    is killed with its group."""
    stack = Stack()
    script = (
        "import os, subprocess, sys, time; print('pid', os.getpid(), sys.argv[1], flush=True); "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('grandchild', g.pid, flush=True); time.sleep(60)"
    )
    await stack.spawn("sleeper", [sys.executable, "-c", script, "marker-arg"], {"SLEEPER_ENV": "1"})
    stack.supervise()
    try:
        (child,) = stack.children
        first = child.proc
        await asyncio.sleep(0.3)
        grandchild = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == first.pid]
        assert len(grandchild) == 1
        first.send_signal(signal.SIGKILL)
        for _ in range(50):  # the fault happened: the process is gone (reaped)
            if first.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert first.returncode == -signal.SIGKILL
        for _ in range(50):
            if child.proc is not first and child.proc.returncode is None:
                break
            await asyncio.sleep(0.1)
        assert child.proc is not first and child.proc.returncode is None
        assert child.restarts == 1 and child.deaths_in_a_row == 1
        assert child.argv[-1] == "marker-arg" and child.env == {"SLEEPER_ENV": "1"}
        assert _ppid(grandchild[0]) is None  # killed with its group (or reaped by init: not ours)
    finally:
        await stack.stop()
    assert child.proc.returncode is not None  # stop() ends the replacement too
    err = capfd.readouterr().err
    assert f"sleeper (pid {first.pid}) ended with signal 9 (SIGKILL)" in err
    assert "restart 1 in 0.5 s" in err
    assert f"sleeper restarted (pid {child.proc.pid}, restart 1)" in err
