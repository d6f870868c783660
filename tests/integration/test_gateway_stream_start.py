"""A streamed response begins when stage 0 says its engine has the request (``started``): before
that, a failure is an HTTP error with its status, a hang-up aborts the request, and silence ends
in a 504. A real gateway process and nats-server; the test plays the orchestrator and stage 0."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import nats
import openai
import pytest

from libs.common.envelopes import AbortNotice, Admission, ClientEvent, ClientEventType, Usage, decode
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "sstart"
SUBJECTS = Subjects(PIPELINE)
TIMEOUT_S = 2.0
"""The pipeline's request timeout: the gateway's own gives up 3 s after it."""


@pytest.fixture(scope="module")
def gateway(nats_server, tmp_path_factory) -> Iterator[Services]:
    """A real gateway alone: the test plays the orchestrator and stage 0."""
    tmp = tmp_path_factory.mktemp("gw")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML, timeout_s=TIMEOUT_S)
    with Services(nats_server.url, path, tmp).start(orchestrators=0).serving() as services:
        yield services


class PlaysPipeline:
    """Sees the gateway's admissions and abort notices; answers as the pipeline would."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.admissions: asyncio.Queue[Admission] = asyncio.Queue()
        self.aborts: asyncio.Queue[AbortNotice] = asyncio.Queue()
        self.sent: dict[str, int] = {}
        """Request id → events sent as stage 0."""

    async def start(self) -> PlaysPipeline:
        async def on_admission(msg) -> None:
            self.admissions.put_nowait(decode(Admission, msg.data))

        async def on_abort(msg) -> None:
            self.aborts.put_nowait(decode(AbortNotice, msg.data))

        await self.nc.subscribe(SUBJECTS.requests, cb=on_admission)
        await self.nc.subscribe(SUBJECTS.abort, cb=on_abort)
        await barrier(self.nc)
        return self

    async def send(self, adm: Admission, **event) -> None:
        """An error as the orchestrator sends it (no stage); anything else as stage 0's replica 0
        sends it, numbered in order (the gateway takes nothing else: docs/security.md)."""
        if event["type"] != ClientEventType.ERROR:
            seq = self.sent.get(adm.request_id, 0)
            self.sent[adm.request_id] = seq + 1
            event = {"stage": 0, "replica": 0, "seq": seq, **event}
        ev = ClientEvent(request_id=adm.request_id, **event)
        await self.nc.publish(SUBJECTS.out(adm.gateway_id, adm.request_id), ev.encode())


@pytest.fixture
async def pipeline_side(nats_server):
    nc = await nats.connect(nats_server.url)
    yield await PlaysPipeline(nc).start()
    await nc.close()


BODY = {
    "model": f"{PIPELINE}-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
    "stream": True,
}


async def test_a_failure_before_the_start_is_an_http_error(gateway, pipeline_side) -> None:
    client = gateway.client()
    call = asyncio.create_task(
        client.chat.completions.create(
            model=BODY["model"], messages=BODY["messages"], max_tokens=4, stream=True
        )
    )
    adm = await asyncio.wait_for(pipeline_side.admissions.get(), 10)
    await pipeline_side.send(
        adm, type=ClientEventType.ERROR, status=503, code="no_live_replica", message="stage 0 has no replica"
    )
    with pytest.raises(openai.APIStatusError) as e:
        await asyncio.wait_for(call, 10)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "no_live_replica" and "no replica" in e.value.body["message"]
    # the other stages are told to stop
    notice = await asyncio.wait_for(pipeline_side.aborts.get(), 5)
    assert notice.request_id == adm.request_id
    await client.close()


async def test_the_stream_begins_at_started_before_any_token(gateway, pipeline_side) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        opening = asyncio.create_task(
            http.send(
                http.build_request("POST", f"{gateway.base_url}/v1/chat/completions", json=BODY), stream=True
            )
        )
        adm = await asyncio.wait_for(pipeline_side.admissions.get(), 10)
        # Time passes with the request admitted and stage 0 silent: the response must not begin in it.
        await asyncio.sleep(0.5)
        assert not opening.done(), "the response began before stage 0 started"
        await pipeline_side.send(adm, type=ClientEventType.STARTED)
        response = await asyncio.wait_for(opening, 5)
        try:
            # status and the role chunk arrive with no token sent yet
            assert response.status_code == 200
            lines = response.aiter_lines()
            first = json.loads((await asyncio.wait_for(anext(lines), 5)).removeprefix("data: "))
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            await pipeline_side.send(adm, type=ClientEventType.TEXT, text="hi", token_ids=[7])
            await pipeline_side.send(
                adm,
                type=ClientEventType.TEXT_DONE,
                finish_reason="length",
                usage=Usage(prompt_tokens=3, completion_tokens=1),
            )
            rest = [line async for line in lines if line.startswith("data: ")]
        finally:
            await response.aclose()
    chunks = [json.loads(x.removeprefix("data: ")) for x in rest[:-1]]
    assert rest[-1] == "data: [DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "hi"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_hang_up_before_the_start_aborts_the_request(gateway, pipeline_side) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        request = asyncio.create_task(http.post(f"{gateway.base_url}/v1/chat/completions", json=BODY))
        adm = await asyncio.wait_for(pipeline_side.admissions.get(), 10)
        request.cancel()  # the connection closes with no response begun
        with pytest.raises(asyncio.CancelledError):
            await request
    notice = await asyncio.wait_for(pipeline_side.aborts.get(), 5)
    assert (notice.request_id, notice.reason) == (adm.request_id, "client disconnected")


async def test_silence_until_past_the_deadline_is_a_504(gateway, pipeline_side) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.create_task(http.post(f"{gateway.base_url}/v1/chat/completions", json=BODY))
        adm = await asyncio.wait_for(pipeline_side.admissions.get(), 10)
        response = await asyncio.wait_for(request, TIMEOUT_S + 3 + 5)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    notice = await asyncio.wait_for(pipeline_side.aborts.get(), 5)
    assert (notice.request_id, notice.reason) == (adm.request_id, "timeout")
