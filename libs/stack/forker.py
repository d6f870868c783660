"""The forker: one Python process that imports a stack's service code (torch and vLLM included) once,
then forks each service from itself, so a service starts, and a dead one starts again, without
importing it anew (a stage worker's imports cost about 7 s of CPU on a 2-core box).

A forked service is the process ``python -m <module> <args>`` would be, with these differences: its
parent is the forker, its command line (``ps``, ``/proc/<pid>/cmdline``) is the one it would have
had followed by ``[<name>]``, its ``/proc/<pid>/environ`` is the forker's (``os.environ`` holds its
own), and of the variables Python reads at its start only ``PYTHONPATH`` is its own (added to
``sys.path``). It runs in a session of its own with its output on the descriptor the stack gave.

The stack and the forker speak over a Unix socket pair (``SOCK_SEQPACKET``: one message per send):

- stack → forker: one JSON request per service to start (``module``, ``args``, ``env``, ``title``)
  with the descriptor its output goes to;
- forker → stack: ``pid <pid>`` for each request, in order, and ``exit <pid> <returncode>`` when a
  child has ended (``-N``: signal N; the forker reaps every child within :data:`REAP_EVERY_S`).

The forker ends when the stack's end of the socket closes; services it started run on, as they
would after their launcher's death without it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import setproctitle

REAP_EVERY_S = 0.05
"""How often the forker collects the exit statuses of its children, seconds."""
MESSAGE_BYTES = 1 << 20
"""The largest request (a service's environment included), bytes."""
ANSWER_TIMEOUT_S = 600.0
"""How long a request may wait for the forker's answer (it answers once its imports are done)."""
LOST_EXIT = 255
"""The return code of a child that ended after its forker was gone (its status went unread)."""


FORKER_ENV = "OMNIRELAY_FORKER"
"""``off``: every service is started as a ``python`` of its own, not forked from a forker."""


def forking_wanted() -> bool:
    """Whether services are forked from a forker (``OMNIRELAY_FORKER`` is not ``off``)."""
    return os.environ.get(FORKER_ENV, "on") != "off"


class ForkerGone(RuntimeError):
    """The forker cannot start a service: it has ended, or does not answer."""


class ForkedProcess:
    """A service the forker started, seen from the stack: what the stack reads of a
    :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``)."""

    def __init__(self, forker: Forker, pid: int, args: list[str]) -> None:
        self.forker, self.pid, self.args = forker, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.forker.exit_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            with self.forker.exited:
                self.forker.exited.wait(REAP_EVERY_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Forker:
    """The stack's end: starts the forker, which imports the modules of ``preload`` (its output to
    descriptor ``out``, else this process's stdout), and asks it for services. Thread-safe: a
    supervisor thread may restart one service while another starts."""

    def __init__(self, preload: Sequence[str], out: int | None = None) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", __name__, str(theirs.fileno()), *preload]
        self.proc = subprocess.Popen(
            argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )  # fmt: skip
        theirs.close()
        self._ask = threading.Lock()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self.exited = threading.Condition()
        """Notified on every answer of the forker, and when it is gone."""
        self.alive = True
        threading.Thread(target=self._read, name="forker-reader", daemon=True).start()

    def fork(self, argv: Sequence[str], env: dict[str, str], out: int, title: str) -> ForkedProcess:
        """Start ``argv`` (``python -m <module> <args>``) with ``env`` as its whole environment
        and ``out`` as its stdout and stderr; ``title``: what follows its command line in ``ps``."""
        assert argv[1] == "-m", f"the forker starts python -m <module> only, not {argv}"
        request = {
            "module": argv[2],
            "args": list(argv[3:]),
            "env": env,
            "title": f"{' '.join(argv)} [{title}]",
        }
        with self._ask:
            if not self.alive:
                raise ForkerGone("the forker is gone")
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out])
            with self.exited:
                if not self.exited.wait_for(lambda: self._pids or not self.alive, ANSWER_TIMEOUT_S):
                    raise ForkerGone(f"the forker did not answer within {ANSWER_TIMEOUT_S:g} s")
                if not self._pids:
                    raise ForkerGone("the forker is gone")
                return ForkedProcess(self, self._pids.pop(0), list(argv))

    def exit_of(self, pid: int) -> int | None:
        """The return code of child ``pid``; None while it runs."""
        with self.exited:
            if pid in self._exits:
                return self._exits[pid]
        if self.alive or _runs(pid):
            return None
        return LOST_EXIT

    def _read(self) -> None:
        while data := _recv(self._sock):
            kind, *numbers = data.split()
            with self.exited:
                if kind == "pid":
                    self._pids.append(int(numbers[0]))
                    self._exits.pop(int(numbers[0]), None)  # a pid used again: a new child
                else:
                    self._exits[int(numbers[0])] = int(numbers[1])
                self.exited.notify_all()
        with self.exited:
            self.alive = False
            self.exited.notify_all()

    def close(self) -> None:
        """End the forker (the services it started are the stack's to stop, before this)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()


def _recv(sock: socket.socket) -> str:
    with contextlib.suppress(OSError):
        return sock.recv(256).decode()
    return ""


def _runs(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- the forker's side ------------------------------------------------------------------------------
def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork one child per request until the stack's end closes (None). In a child, the request
    it was forked for."""
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_EVERY_S)
        _report_exits(sock)
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
        if not data:
            return None
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become(request, fds[0])
            return request
        os.close(fds[0])
        sock.send(f"pid {pid}".encode())


def _become(request: dict[str, Any], out: int) -> None:
    """In a forked child: a session, output and environment of its own, and its title."""
    os.setsid()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    setproctitle.setproctitle(request["title"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra  # where python puts PYTHONPATH: after the script's (here: the cwd's) entry


def main(argv: list[str]) -> None:
    """``python -m libs.stack.forker <socket fd> <module to import>...``"""
    sock = socket.socket(fileno=int(argv[0]))
    setproctitle.setproctitle(" ".join([sys.executable, "-m", __spec__.name, *argv]))  # ready to retitle
    for module in argv[1:]:
        importlib.import_module(module)
    request = serve(sock)
    if request is None:
        return
    import runpy

    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
