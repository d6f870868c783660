"""Fixtures of the integration tests (the nats-server itself comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from tests.nats_cluster import cluster  # noqa: F401 (a fixture of the tests that need a 3-node cluster)


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[Client]:
    """A connection of the test's own to the session's nats-server."""
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()
