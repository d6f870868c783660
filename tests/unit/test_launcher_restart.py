"""How ``omnirelay up`` restarts a process that died: back-off and how the end is reported."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from cli.launcher import RESTART_MAX_DELAY_S, Stack, exit_status, restart_delay
from tests.procs import until


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

        def grandchildren() -> list[int]:
            return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == first.pid]

        (grandchild,) = await until(grandchildren, "the child's own child started")
        first.send_signal(signal.SIGKILL)
        # the fault happened: the process is gone (reaped)
        await until(lambda: first.returncode is not None, "the killed child reaped")
        assert first.returncode == -signal.SIGKILL
        # back-off 0.5 s; the grandchild holds the old pipe for 60 s, which the restart must not wait for
        await until(
            lambda: child.proc is not first and child.proc.returncode is None,
            "a new process started",
            timeout_s=20,
        )
        assert child.restarts == 1 and child.deaths_in_a_row == 1
        # the new process runs the same command with the same environment (as the kernel has them)
        new = child.proc.pid
        assert Path(f"/proc/{new}/cmdline").read_bytes().split(b"\0")[-2:] == [b"marker-arg", b""]
        assert b"SLEEPER_ENV=1" in Path(f"/proc/{new}/environ").read_bytes().split(b"\0")
        # killed with its group (or reaped by init: not ours), long before its 60 s are up
        await until(lambda: _ppid(grandchild) is None, f"the grandchild {grandchild} gone")
    finally:
        await stack.stop()
    assert child.proc.returncode is not None  # stop() ends the replacement too
    err = capfd.readouterr().err
    assert f"sleeper (pid {first.pid}) ended with signal 9 (SIGKILL)" in err
    assert "restart 1 in 0.5 s" in err
    assert f"sleeper restarted (pid {child.proc.pid}, restart 1)" in err
