"""The processes a stack is made of, however it is run (``omnirelay up``, the tests, the benchmarks,
the fault suite): each started in a session of its own, its output appended to a log file or copied
to this process's stdout with its name before each line, stopped with everything it started, and,
once supervised, started again by a restart policy when it exits.

Clocks: ``time.monotonic()`` of this process for durations and deadlines, seconds;
``time.time_ns()`` for :attr:`Process.started_ns`, which services' records are compared with.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import psutil

from libs.stack.forker import ForkedProcess, Forker, ForkerGone

T = TypeVar("T")

EXIT_POLL_S = 0.1
"""How often a supervised process is checked for having exited, seconds."""
_STDOUT_LOCK = threading.Lock()
"""Whole lines from several processes' copies reach stdout one at a time."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised process that exited is started again: after ``first_delay_s``, doubling
    with each exit in a row up to ``max_delay_s``; a process that ran ``stable_after_s`` or longer
    before it exited starts over at ``first_delay_s`` (it was not crash-looping). Seconds."""

    first_delay_s: float
    max_delay_s: float
    stable_after_s: float

    def delay_s(self, exits_in_a_row: int) -> float:
        """The wait before restart after exit number ``exits_in_a_row`` (1: the first in a row)."""
        return min(self.first_delay_s * 2 ** max(exits_in_a_row - 1, 0), self.max_delay_s)

    def exits_in_a_row(self, before: int, ran_s: float) -> int:
        """The count after one more exit, of a process that ran ``ran_s`` seconds."""
        return 1 if ran_s >= self.stable_after_s else before + 1


LAUNCHER_RESTARTS = RestartPolicy(first_delay_s=0.5, max_delay_s=30.0, stable_after_s=60.0)
"""``omnirelay up``'s policy: 0.5 s, 1, 2, ... 30 s; a minute of running resets it."""
COMPOSE_RESTARTS = RestartPolicy(first_delay_s=0.1, max_delay_s=60.0, stable_after_s=10.0)
"""Docker's ``restart: unless-stopped`` (moby's restart manager): 0.1 s, doubling up to 60 s; ten
seconds of running resets it."""


def exit_status(returncode: int) -> str:
    """A process's end as an operator reads it: ``exit 1`` or ``signal 9 (SIGKILL)``."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {-returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"signal {-returncode}"


def copy_lines(name: str, source: IO[bytes], width: int, out: IO[str] | None = None) -> None:
    """Copy ``source`` to ``out`` (default stdout) line by line, each line prefixed with ``name``
    padded to ``width``; a last line without a newline gets one. Returns at end of file."""
    prefix = f"{name:<{width}} | "
    for line in iter(source.readline, b""):
        text = line.decode(errors="replace")
        with _STDOUT_LOCK:
            target = out or sys.stdout
            target.write(prefix + text + ("" if text.endswith("\n") else "\n"))
            target.flush()


def copied_to_stdout(name: str, width: int) -> int:
    """A pipe whose lines reach this process's stdout as :func:`copy_lines` copies them (in a
    thread, until every write end is closed); its write end, for the caller to hand on and close."""
    read, write = os.pipe()
    source = os.fdopen(read, "rb")
    threading.Thread(target=copy_lines, args=(name, source, width), name=f"copy:{name}", daemon=True).start()
    return write


class Process:
    """One process of a stack: ``argv`` with ``env`` over this process's environment (over
    nothing unless ``inherit_env``), in ``cwd``.

    Its output goes to ``log_path`` (appended: a restarted process continues its log), or, without
    one, to this process's stdout with ``name`` before each line (``prefix_width`` wide). It runs
    in a session of its own, so a terminal's Ctrl-C reaches only the caller, which stops it in
    order, and its process group (vLLM's EngineCore) is killed when it ends or is stopped. With a
    ``forker`` (:mod:`libs.stack.forker`), a ``python -m`` command is forked from it while it runs.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        *,
        prefix_width: int = 12,
        stop_signal: int = signal.SIGTERM,
        stop_timeout_s: float = 30.0,
        cwd: Path | None = None,
        inherit_env: bool = True,
        forker: Forker | None = None,
    ) -> None:
        self.name, self.argv, self.env, self.log_path = name, list(argv), dict(env or {}), log_path
        self.prefix_width, self.stop_signal, self.stop_timeout_s = prefix_width, stop_signal, stop_timeout_s
        self.cwd, self.inherit_env, self.forker = cwd, inherit_env, forker
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        """The running incarnation (the last one started)."""
        self.started_s = 0.0
        """``time.monotonic()`` at the last start."""
        self.started_ns = 0
        """``time.time_ns()`` at the last start: a service's registry record of this incarnation
        was started after it."""
        self.restarts = 0
        self.exits_in_a_row = 0
        self._offset = 0
        """Where the last incarnation's output begins in :attr:`log_path`, bytes."""
        self._stopping = threading.Event()
        self._not_before_s = 0.0
        """No restart before this ``time.monotonic()`` (``math.inf``: held until :meth:`release`)."""
        self._supervisor: threading.Thread | None = None

    # --- running --------------------------------------------------------------------------------
    def start(self) -> Process:
        """Start the process (again: same command, environment and log)."""
        env = {**(os.environ if self.inherit_env else {}), **self.env, "PYTHONUNBUFFERED": "1"}
        self.started_s, self.started_ns = time.monotonic(), time.time_ns()
        if self.log_path is None:
            write = copied_to_stdout(self.name, self.prefix_width)
            self.proc = self._launch(env, write)
            os.close(write)
            return self
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as out:
            self.proc = self._launch(env, out.fileno())
        return self

    def _launch(self, env: dict[str, str], out: int) -> subprocess.Popen[bytes] | ForkedProcess:
        forkable = self.argv[:2] == [sys.executable, "-m"] and self.cwd is None
        if forkable and self.forker is not None and self.forker.alive:
            with contextlib.suppress(ForkerGone):  # then a python of its own
                return self.forker.fork(self.argv, env, out, self.name)
        return subprocess.Popen(
            self.argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.cwd,
            start_new_session=True,
        )

    def _thread(self, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(
            target=target, args=args, name=f"{target.__name__}:{self.name}", daemon=True
        )
        thread.start()
        return thread

    @property
    def pid(self) -> int:
        """The pid of the running incarnation."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """None while the running incarnation runs; else how it ended (``-N``: signal N)."""
        return None if self.proc is None else self.proc.poll()

    def text(self) -> str:
        """What the running incarnation has written to :attr:`log_path` so far."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self._offset)
            return f.read().decode(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.text()[-chars:]

    def ended(self) -> str | None:
        """``name (exit 1)`` once the running incarnation has ended, else None."""
        code = self.returncode
        return None if code is None else f"{self.name} ({exit_status(code)})"

    def signal_family(self, sig: int) -> None:
        """Send ``sig`` to the process and everything it started (SIGSTOP, SIGCONT: an idle vLLM
        is not idle, its executor polls shared memory, so a paused target is frozen whole)."""
        for pid in [self.pid, *(p.pid for p in _children(self.pid))]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def pause(self) -> None:
        """SIGSTOP the process and everything it started."""
        self.signal_family(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process and everything it started."""
        self.signal_family(signal.SIGCONT)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """End any supervision, then send the stop signal (after SIGCONT: a stopped process would
        not act on it), wait up to ``timeout_s`` (default :attr:`stop_timeout_s`), and SIGKILL the
        process group and every process it started. Its return code (None: never started)."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            family = _children(self.proc.pid)
            self.signal_family(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(self.stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            for p in family:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    # --- supervision ----------------------------------------------------------------------------
    def supervise(self, policy: RestartPolicy, note: Callable[[str], None]) -> None:
        """From now on, start the process again whenever it exits, as ``policy`` says (in a thread
        of this process); ``note`` gets one line per exit and one per restart."""
        self._stopping.clear()  # a process stopped and started again may be supervised again
        self._supervisor = self._thread(self._keep_running, policy, note)

    def _keep_running(self, policy: RestartPolicy, note: Callable[[str], None]) -> None:
        while not self._stopping.wait(EXIT_POLL_S):
            proc = self.proc
            assert proc is not None
            if proc.poll() is None:
                continue
            exited_s = time.monotonic()
            ran_s = exited_s - self.started_s
            self.exits_in_a_row = policy.exits_in_a_row(self.exits_in_a_row, ran_s)
            delay_s = policy.delay_s(self.exits_in_a_row)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it started (vLLM's engine) goes too
            held = " (held)" if self._not_before_s > exited_s + delay_s else ""
            note(
                f"{self.name} (pid {proc.pid}) ended with {exit_status(proc.returncode)} after "
                f"{ran_s:.1f} s; restart {self.restarts + 1} in {delay_s:g} s{held}"
            )
            while time.monotonic() < max(exited_s + delay_s, self._not_before_s):
                if self._stopping.wait(0.05):
                    return
            self.start()
            self.restarts += 1
            note(f"{self.name} restarted (pid {self.pid}, restart {self.restarts})")

    def hold(self, seconds: float | None = None) -> None:
        """Defer the next restart: until ``seconds`` from now, or (None) until :meth:`release`."""
        self._not_before_s = math.inf if seconds is None else time.monotonic() + seconds

    def release(self) -> None:
        """Let the policy restart the process now, or as soon as its back-off allows."""
        self._not_before_s = 0.0

    def wait_restarted(self, restarts_before: int, timeout_s: float) -> int:
        """Wait until the process has been restarted since ``restarts_before`` restarts; its new pid."""
        wait_for(lambda: self.restarts > restarts_before, f"{self.name} restarted", timeout_s)
        return self.pid


def _children(pid: int) -> list[psutil.Process]:
    """Every process ``pid`` started, and theirs (psutil knows each by pid and start time, so a
    pid reused later is never signalled)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _failure(watch: Iterable[Process]) -> str | None:
    ended = [e for p in watch if (e := p.ended()) is not None]
    if not ended:
        return None
    tails = "\n".join(
        f"--- {p.name}\n{p.log_tail()}" for p in watch if p.returncode is not None and p.log_path
    )
    return f"exited: {', '.join(ended)}\n{tails}".rstrip()


def wait_for(
    check: Callable[[], T], what: str, timeout_s: float, every_s: float = 0.05, watch: Iterable[Process] = ()
) -> T:
    """Ask ``check`` every ``every_s`` seconds until it answers something truthy, and return that
    answer. Fails (``RuntimeError``) naming ``what`` when ``timeout_s`` seconds pass first, or at
    once when a process of ``watch`` exits (with the end of its log). The blocking twin of
    :func:`until`."""
    watch = list(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        if answer := check():
            return answer
        if failure := _failure(watch):
            raise RuntimeError(f"{what}: a process ended first: {failure}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g} s (last answer {answer!r})")
        time.sleep(every_s)


async def until(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    timeout_s: float = 10.0,
    every_s: float = 0.05,
    watch: Iterable[Process] = (),
) -> T:
    """:func:`wait_for` inside an event loop: ``check`` may be a coroutine function, and the loop
    runs on between questions. Fails with ``AssertionError`` (a test's failure) naming ``what``."""
    watch = list(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        answer = check()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return answer  # type: ignore[return-value]
        if failure := _failure(watch):
            raise AssertionError(f"{what}: a process ended first: {failure}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last answer {answer!r})")
        await asyncio.sleep(every_s)
