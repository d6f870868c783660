"""libs/common/record_updates.read_record against a real nats-server that goes away and comes back:
a talker reads a request's voice and position notes this way, and a broker restart longer than a
JetStream request's timeout must not fail the request."""

from __future__ import annotations

import asyncio
import signal
import time

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from libs.common.bus import requests_kv
from libs.common.record_updates import read_record
from libs.common.records import RequestRecord, RequestStatus
from tests.conftest import NatsServer
from tests.procs import gone

pytestmark = pytest.mark.integration

JS_TIMEOUT_S = 1.0
"""The test client's JetStream request timeout, seconds: a read sent while the broker is down fails
after it, and read_record must send it again."""
DOWN_S = 3.0
"""How long the broker stays down, seconds: three timeouts' worth."""


def _record(request_id: str) -> RequestRecord:
    now = time.time_ns()
    return RequestRecord(
        request_id=request_id,
        pipeline="reads",
        gateway_id="gw",
        status=RequestStatus.RUNNING,
        route=[0, 0, 0],
        arrival_ns=now,
        admitted_ns=now,
        deadline_ns=now + 60 * 10**9,
        updated_ns=now,
        voice="leo",
    )


async def test_a_read_outlasts_a_broker_restart_and_gives_up_at_the_deadline(tmp_path) -> None:
    server = NatsServer(tmp_path / "jetstream")
    server.start()
    nc = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    try:
        kv = await requests_kv(nc.jetstream(timeout=JS_TIMEOUT_S))
        stored = _record("r-1")
        await kv.put(stored.request_id, stored.model_dump_json().encode())
        assert await read_record(kv, "no-such-request", time.time_ns() + 10**9) is None

        pid = server.proc.pid
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(5)
        assert gone(pid), "nats-server still runs"
        # Down, with a deadline nearer than the broker's return: the read's own error, on time.
        began = time.monotonic()
        with pytest.raises(NatsTimeoutError):
            await read_record(kv, stored.request_id, time.time_ns() + int(JS_TIMEOUT_S * 1.5e9))
        assert time.monotonic() - began < JS_TIMEOUT_S * 3
        # Down for several timeouts, then back (the same port and store): the read returns the record.
        read = asyncio.create_task(read_record(kv, stored.request_id, time.time_ns() + 30 * 10**9))
        await asyncio.sleep(DOWN_S)
        assert not read.done(), "the read ended while the broker was down"
        server.start()
        assert await asyncio.wait_for(read, 20) == stored
    finally:
        await nc.close()
        server.stop()
