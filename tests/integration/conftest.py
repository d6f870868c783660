"""Fixtures of the integration tests (the nats-server itself comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client

from tests.nats_cluster import cluster  # noqa: F401 (a fixture of the tests that need a 3-node cluster)
from tests.thinker_pair import ThinkerPair, start_pair, stop_pair


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[Client]:
    """A connection of the test's own to the session's nats-server."""
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


@pytest.fixture(scope="package")
def thinker_pair(nats_server, tmp_path_factory) -> Iterator[ThinkerPair]:
    """A gateway and two thinker workers on the session's nats-server, shared by the modules that
    judge faults with a second replica to move to (``tests/thinker_pair.py``); no orchestrator."""
    pair = start_pair(nats_server.url, tmp_path_factory.mktemp("thinkerpair"))
    yield pair
    stop_pair(pair)
