"""How a supervised process of a stack (``omnirelay up``'s, the fault suite's) is restarted when it
dies: back-off, and how the end is reported."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from libs.stack.processes import COMPOSE_RESTARTS, LAUNCHER_RESTARTS, Process, exit_status, until


def _ppid(pid: int) -> int | None:
    """The parent of a live ``pid``; None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def test_the_launchers_back_off_doubles_from_half_a_second_and_is_capped() -> None:
    assert [LAUNCHER_RESTARTS.delay_s(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert LAUNCHER_RESTARTS.delay_s(50) == 30.0


def test_a_process_that_ran_long_enough_starts_its_back_off_over() -> None:
    assert LAUNCHER_RESTARTS.exits_in_a_row(5, ran_s=59.9) == 6
    assert LAUNCHER_RESTARTS.exits_in_a_row(5, ran_s=60.0) == 1
    assert COMPOSE_RESTARTS.exits_in_a_row(5, ran_s=10.0) == 1


def test_exit_status_names_the_signal() -> None:
    assert exit_status(0) == "exit 0"
    assert exit_status(3) == "exit 3"
    assert exit_status(-signal.SIGKILL) == "signal 9 (SIGKILL)"
    assert exit_status(-signal.SIGSEGV) == "signal 11 (SIGSEGV)"


async def test_a_supervised_process_that_dies_is_started_again_with_its_command() -> None:
    """A real child killed with SIGKILL: gone, then a new process with the same command. Like a
    worker, whose vLLM engine processes outlive it and hold its stdout, it leaves a grandchild
    behind that keeps the pipe open; the restart must not wait for that pipe, and the grandchild
    is killed with its group."""
    notes: list[str] = []
    script = (
        "import os, subprocess, sys, time; print('pid', os.getpid(), sys.argv[1], flush=True); "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('grandchild', g.pid, flush=True); time.sleep(60)"
    )
    child = Process("sleeper", [sys.executable, "-c", script, "marker-arg"], {"SLEEPER_ENV": "1"}).start()
    child.supervise(LAUNCHER_RESTARTS, notes.append)
    try:
        first = child.proc
        assert first is not None

        def grandchildren() -> list[int]:
            return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == first.pid]

        (grandchild,) = await until(grandchildren, "the child's own child started")
        first.send_signal(signal.SIGKILL)
        # the fault happened: the process is gone (reaped)
        await until(lambda: first.poll() is not None, "the killed child reaped")
        assert first.returncode == -signal.SIGKILL
        # back-off 0.5 s; the grandchild holds the old pipe for 60 s, which the restart must not wait for
        await until(lambda: child.restarts == 1, "a new process started", timeout_s=20)
        assert child.proc is not first and child.returncode is None and child.exits_in_a_row == 1
        # the new process runs the same command with the same environment (as the kernel has them)
        new = child.pid
        assert Path(f"/proc/{new}/cmdline").read_bytes().split(b"\0")[-2:] == [b"marker-arg", b""]
        assert b"SLEEPER_ENV=1" in Path(f"/proc/{new}/environ").read_bytes().split(b"\0")
        # killed with its group (or reaped by init: not ours), long before its 60 s are up
        await until(lambda: _ppid(grandchild) is None, f"the grandchild {grandchild} gone")
    finally:
        child.stop()
    assert child.returncode is not None  # stop() ends the replacement too
    ended, restarted = notes  # one line per exit, one per restart: what an operator reads
    assert ended.startswith(f"sleeper (pid {first.pid}) ended with signal 9 (SIGKILL) after ")
    assert ended.endswith("; restart 1 in 0.5 s")
    assert restarted == f"sleeper restarted (pid {child.pid}, restart 1)"


def test_the_compose_policy_backs_off_as_docker_does() -> None:
    """Docker's documented rule for a container with a restart policy: 100 ms before the first
    restart, doubling with every exit in a row, at most one minute; a container that ran at least
    10 s starts over at 100 ms."""
    delays, exits = [], 0
    for _ in range(12):  # a service that crashes at once, again and again
        exits = COMPOSE_RESTARTS.exits_in_a_row(exits, ran_s=0.5)
        delays.append(COMPOSE_RESTARTS.delay_s(exits))
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2, 60.0, 60.0]
    assert COMPOSE_RESTARTS.delay_s(COMPOSE_RESTARTS.exits_in_a_row(11, ran_s=10.0)) == 0.1
    assert COMPOSE_RESTARTS.delay_s(COMPOSE_RESTARTS.exits_in_a_row(2, ran_s=9.9)) == 0.4


async def test_a_held_restart_waits_for_the_release_and_a_stopped_process_is_not_restarted(
    tmp_path: Path,
) -> None:
    """A real process under the compose policy, logging to a file: killed while held, it stays
    down past its back-off, comes back once released, and the log goes on in the same file."""
    notes: list[str] = []
    log = tmp_path / "sleeper.log"
    script = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    service = Process("sleeper", [sys.executable, "-c", script], {}, log).start()
    service.supervise(COMPOSE_RESTARTS, notes.append)
    try:
        first = service.pid
        await until(lambda: f"pid {first}" in service.text(), "the first incarnation's output")
        service.hold()
        os.kill(first, signal.SIGKILL)
        await until(lambda: len(notes) == 1, "the exit noted")
        assert notes[0].endswith("restart 1 in 0.1 s (held)")
        await asyncio.sleep(1.0)  # 10 x the back-off: an unheld restart would have come by now
        assert service.restarts == 0 and service.returncode == -signal.SIGKILL
        service.release()
        await until(lambda: service.restarts == 1, "the restart after the release")
        await until(lambda: f"pid {service.pid}" in service.text(), "the new incarnation's output")
        assert f"pid {first}\n" in log.read_text()  # appended: the first incarnation's line stays
    finally:
        service.stop()
    assert service.returncode is not None and service.restarts == 1
