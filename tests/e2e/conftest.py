"""The whole stack, started once per session with ``omnirelay up`` against the test's NATS."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cli.stack_file import read_live_stack
from libs.common.pipeline import load_pipeline
from libs.stack.local_nats import free_port
from tests.conftest import NatsServer
from tests.e2e.prometheus_events import dead_lettered, events  # noqa: F401 (fixtures of test_prometheus.py)
from tests.e2e.prometheus_server import prom  # noqa: F401 (a fixture of test_prometheus.py)
from tests.otlp_receiver import Receiver, start_receiver
from tests.procs import stop_process

START_TIMEOUT_S = 420.0


@dataclass
class Stack:
    base_url: str
    nats_url: str
    log: Path
    proc: subprocess.Popen[bytes]
    admin_url: str = ""
    """The gateway's admin listener (``/metrics``, ``/prometheus/targets``; no API key), as the
    launcher reports it in ``stack.json`` (``up --admin-port 0``: a free port)."""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, *needles: str, timeout_s: float = 15.0) -> str:
        """The first log line containing every one of ``needles`` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_text().splitlines():
                if all(n in line for n in needles):
                    return line
            time.sleep(0.2)
        raise AssertionError(f"no log line containing {needles!r} within {timeout_s} s")

    async def await_log(self, *needles: str, timeout_s: float = 15.0) -> str:
        """:meth:`wait_log` for async tests (does not block their event loop)."""
        return await asyncio.to_thread(self.wait_log, *needles, timeout_s=timeout_s)


@pytest.fixture(scope="session")
def pipeline():
    return load_pipeline()


@pytest.fixture(scope="session")
def otlp() -> Iterator[Receiver]:
    """Where every service of the stack exports its spans (OTLP/HTTP)."""
    server, receiver = start_receiver()
    receiver.endpoint = f"http://127.0.0.1:{server.server_port}"
    yield receiver
    server.shutdown()


@pytest.fixture(scope="session")
def stack(
    nats_server: NatsServer, otlp: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    log = tmp / "stack.log"
    port = free_port()
    env = {
        **os.environ,
        "NATS_URL": nats_server.url,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    argv = [
        sys.executable,
        "-m",
        "cli",
        "up",
        "--port",
        str(port),
        "--admin-port",
        "0",
        "--data-dir",
        str(tmp),
        "--log-stats",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    s = Stack(f"http://127.0.0.1:{port}", nats_server.url, log, proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        # Up once the banner is out and stack.json (written just after it) names the admin port.
        while "omnirelay is up" not in s.log_text() or (info := read_live_stack(tmp)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stack did not come up (exit {proc.poll()}):\n{s.log_text()[-5000:]}")
            time.sleep(1)
        assert httpx.get(f"{s.base_url}/health").status_code == 200
        assert info.gateway_admin_url, f"{tmp}/stack.json names no admin URL"
        s.admin_url = info.gateway_admin_url
        yield s
    finally:
        stop_process(proc, signal.SIGINT, 60)
