"""The whole stack, started once per session with ``omnirelay up`` against the test's NATS
(:mod:`tests.e2e.launched`)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from libs.common.pipeline import load_pipeline
from tests.conftest import NatsServer
from tests.e2e.launched import START_TIMEOUT_S, Launched, close_otlp_receiver, launched, otlp_receiver
from tests.e2e.prometheus_events import dead_letter_under_way, dead_lettered, events  # noqa: F401 (fixtures of test_prometheus.py)
from tests.e2e.prometheus_server import prom  # noqa: F401 (a fixture of test_prometheus.py)
from tests.otlp_receiver import Receiver
from tests.procs import stop_process


@pytest.fixture(scope="package")
def pipeline():
    return load_pipeline()


@pytest.fixture(scope="package")
def otlp() -> Iterator[Receiver]:
    """Where every service of the stack exports its spans (OTLP/HTTP)."""
    yield otlp_receiver()
    close_otlp_receiver()


@pytest.fixture(scope="package")
def stack(
    nats_server: NatsServer, otlp: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    stack = launched(nats_server.url, tmp_path_factory)
    try:
        asyncio.run(stack.up(START_TIMEOUT_S))
        yield stack
    finally:
        assert stack.proc is not None
        stop_process(stack.proc, signal.SIGINT, 60)
