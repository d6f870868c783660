"""The e2e session's stack: ``omnirelay up`` against the session's nats-server, every service
exporting its spans to the session's OTLP receiver. Started once, by the first fixture that asks
or, under ``make test``, when the session starts (``tests/conftest.py``): then ``up``'s forker imports
torch and vLLM (~12 s of a core) and its engines start while pytest collects, not after."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from cli.stack_file import StackInfo, read_live_stack
from libs.stack.local_nats import free_port
from libs.stack.processes import until
from tests.otlp_receiver import Receiver, start_receiver
from tests.pipeline_services import CLIENT_TIMEOUT_S, openai_client
from tests.procs import ServiceProcess

START_TIMEOUT_S = 420.0
"""How long ``omnirelay up`` may take until every replica is live behind its gateway, seconds."""


class Launched(ServiceProcess):
    """``omnirelay up``: the whole stack as its launcher runs it, one process tree that starts
    and restarts the services itself (a test module that starts them by hand uses
    :class:`tests.pipeline_services.Services`). Its log holds the launcher's lines and every
    service's: :meth:`log_text`, :meth:`wait_log`."""

    def __init__(self, data_dir: Path, nats_url: str, env: dict[str, str]) -> None:
        port = free_port()
        args = ["up", "--port", str(port), "--admin-port", "0", "--data-dir", str(data_dir), "--log-stats"]
        # A new Python, not a fork of the session's forker: it may start before that forker's
        # imports are done, and ``up`` imports what its services need in a forker of its own.
        super().__init__(args, {"NATS_URL": nats_url, **env}, data_dir / "stack.log", forked=False)
        self.data_dir, self.nats_url = data_dir, nats_url
        self.base_url = f"http://127.0.0.1:{port}"
        """The gateway's root URL (``/health``; the OpenAI API is below ``/v1``)."""
        self.shared = True

    def log_text(self) -> str:
        """Everything the stack has logged so far."""
        return self.text()

    def client(self, timeout_s: float = CLIENT_TIMEOUT_S, **headers: str) -> openai.AsyncOpenAI:
        """The official async client of the stack's gateway (``openai_client``)."""
        return openai_client(self.base_url, timeout_s, **headers)

    async def up(self, timeout_s: float) -> None:
        """Wait until the launcher says where the stack is (``stack.json``, written once every
        replica is live behind the gateway) and ``/health`` answers 200; then :attr:`admin_url`
        (``up --admin-port 0``: a free port) is the one ``stack.json`` names. Fails if the
        launcher exits, or after ``timeout_s`` seconds."""

        async def described() -> StackInfo | None:
            assert self.proc is not None and self.proc.poll() is None, (
                f"omnirelay up exited ({self.proc and self.proc.poll()}):\n{self.text()[-5000:]}"
            )
            return read_live_stack(self.data_dir)

        info = await until(described, "omnirelay up's stack.json", timeout_s, every_s=1.0)
        assert info.gateway_admin_url, f"{self.data_dir}/stack.json names no admin URL"
        self.metrics_url = f"{info.gateway_admin_url}/metrics"
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(f"{self.base_url}/health")).status_code == 200


_RECEIVER: list[tuple[ThreadingHTTPServer, Receiver]] = []
_STACK: list[Launched] = []


def otlp_receiver() -> Receiver:
    """The session's OTLP/HTTP receiver (started on the first call): its :attr:`Receiver.endpoint`
    is where every service of the stack exports its spans."""
    if not _RECEIVER:
        server, receiver = start_receiver()
        receiver.endpoint = f"http://127.0.0.1:{server.server_port}"
        _RECEIVER.append((server, receiver))
    return _RECEIVER[0][1]


def close_otlp_receiver() -> None:
    while _RECEIVER:
        _RECEIVER.pop()[0].shutdown()


def launched(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """The session's stack on ``nats_url``, started on the first call; not waited for (:meth:`Launched.up`)."""
    if not _STACK:
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver().endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        _STACK.append(Launched(tmp_path_factory.mktemp("stack"), nats_url, env).start())
    return _STACK[0]
