"""A gateway stopped or starved for longer than its admission's publish timeout, with the stream's
ack already in its socket, still admits the request, once, rather than tell its client 503
``bus_unavailable`` ("not queued") for a request that was queued: after a stall the event loop runs
the due timer before it reads what arrived meanwhile, and the gateway then asks the stream again
with the same ``Nats-Msg-Id``. A real nats-server; the stall is the test's own event loop blocked
while it waits for the ack."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from libs.common.pipeline import PipelineConfig
from libs.common.settings import GatewaySettings
from libs.common.subjects import Subjects
from services.gateway import pipeline_client
from services.gateway.pipeline_client import PipelineClient
from tests.bus import text_admission

pytestmark = pytest.mark.integration

PIPELINE = PipelineConfig.model_validate(
    {
        "name": "stalled",
        "served_model_name": "stalled-model",
        "stages": [{"name": "thinker", "type": "llm", "model": "m", "consumes": "text", "emits": "text"}],
    }
)
TIMEOUT_S = 0.3
"""The admission's publish timeout in this test, seconds."""
STALL_S = 1.0
"""How long the gateway's loop is blocked right after it sent the admission, seconds."""


async def test_an_ack_read_after_the_timeout_admits_the_request_once(nats_server, monkeypatch) -> None:
    settings = GatewaySettings(nats_url=nats_server.url, instance_id=f"gw-{uuid.uuid4().hex[:6]}")
    client = PipelineClient(settings, PIPELINE, lambda _: None, lambda _: None, lambda _: None)
    await client.start()
    try:
        js = client.js
        stream = Subjects(PIPELINE.name).requests_stream
        await js.purge_stream(stream)
        monkeypatch.setattr(pipeline_client, "PUBLISH_TIMEOUT_S", TIMEOUT_S)
        send, stalled = client.nc.publish, []

        async def send_then_stall(*args, **kwargs) -> None:
            await send(*args, **kwargs)
            if not stalled and args and args[0] == client.subjects.requests:
                stalled.append(time.monotonic())  # blocks the loop once it waits for the ack
                asyncio.get_running_loop().call_soon(time.sleep, STALL_S)

        monkeypatch.setattr(client.nc, "publish", send_then_stall)
        adm = text_admission(client.gateway_id)
        handle = await client.submit(adm, {})
        assert stalled and time.monotonic() - stalled[0] >= STALL_S  # the stall happened
        assert handle.request_id == adm.request_id
        assert (await js.stream_info(stream)).state.messages == 1
    finally:
        await client.stop()
