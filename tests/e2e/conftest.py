"""The whole stack, started once per session with ``omnirelay up`` against the test's NATS."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cli.stack_file import StackInfo, read_live_stack
from libs.common.pipeline import load_pipeline
from libs.stack.local_nats import free_port
from libs.stack.processes import until
from tests.conftest import NatsServer
from tests.e2e.prometheus_events import dead_letter_under_way, dead_lettered, events  # noqa: F401 (fixtures of test_prometheus.py)
from tests.e2e.prometheus_server import prom  # noqa: F401 (a fixture of test_prometheus.py)
from tests.otlp_receiver import Receiver, start_receiver
from tests.pipeline_services import CLIENT_TIMEOUT_S, openai_client
from tests.procs import ServiceProcess, stop_process

START_TIMEOUT_S = 420.0


class Launched(ServiceProcess):
    """``omnirelay up``: the whole stack as its launcher runs it, one process tree that starts
    and restarts the services itself (a test module that starts them by hand uses
    :class:`tests.pipeline_services.Services`). Its log holds the launcher's lines and every
    service's: :meth:`log_text`, :meth:`wait_log`."""

    def __init__(self, data_dir: Path, nats_url: str, env: dict[str, str]) -> None:
        port = free_port()
        args = ["up", "--port", str(port), "--admin-port", "0", "--data-dir", str(data_dir), "--log-stats"]
        super().__init__(args, {"NATS_URL": nats_url, **env}, data_dir / "stack.log")
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


@pytest.fixture(scope="package")
def pipeline():
    return load_pipeline()


@pytest.fixture(scope="package")
def otlp() -> Iterator[Receiver]:
    """Where every service of the stack exports its spans (OTLP/HTTP)."""
    server, receiver = start_receiver()
    receiver.endpoint = f"http://127.0.0.1:{server.server_port}"
    yield receiver
    server.shutdown()


@pytest.fixture(scope="package")
def stack(
    nats_server: NatsServer, otlp: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    launched = Launched(tmp_path_factory.mktemp("stack"), nats_server.url, env).start()
    try:
        asyncio.run(launched.up(START_TIMEOUT_S))
        yield launched
    finally:
        assert launched.proc is not None
        stop_process(launched.proc, signal.SIGINT, 60)
