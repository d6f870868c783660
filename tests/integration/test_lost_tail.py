"""Client events lost on their way to the gateway (core NATS is at most once: a broker killed
while it holds them drops them). A real gateway and a real orchestrator; the test plays the thinker
replica and, as the fault, does not send some events. A gap is filled by the sender's replay. The
last events show no gap: the thinker's ending lifecycle event (JetStream, durable) says how many
events it sent, the orchestrator passes that on to the gateway, which has them sent again — or,
when the sender cannot (it died), ends the stream at once: with the ``text_done`` made from the
notice when only that was lost, with a 502 ``events_lost`` error when content was — instead of
letting the client wait for the deadline.
"""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    LifecycleEvent,
    Replay,
    ReplayAsk,
    StageTask,
    Usage,
    decode,
)
from libs.common.local_nats import free_port
from libs.common.publish import publish_lifecycle
from libs.common.subjects import Subjects
from tests.bus import played_worker
from tests.procs import THINKER_YAML, start_service, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "losttail"
SUBJECTS = Subjects(PIPELINE)
TIMEOUT_S = 60.0
"""The request timeout: a stream that waited for it would fail the test's bounds by far."""
AT_ONCE_S = TIMEOUT_S / 4
"""A stream that ends sooner than this after the stage did ended at once, not at its deadline
(the slack is for a busy machine), seconds."""
TOKENS = ["Hello", ",", " there", "!"]


@pytest.fixture(scope="module")
def services(nats_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("losttail")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML, timeout_s=TIMEOUT_S)
    port = free_port()
    orch = start_service(["orchestrator"], nats_server.url, path, tmp / "orch.log")
    gateway = start_service(["gateway", "--port", str(port)], nats_server.url, path, tmp / "gw.log")
    orch.wait_log("ready")
    gateway.wait_log("Uvicorn running")
    yield f"http://127.0.0.1:{port}", gateway
    orch.stop()
    assert gateway.stop() in (0, -signal.SIGTERM)


async def play(nc, task: StageTask, lose: int, lose_seq: int | None = None, replays: bool = True) -> Usage:
    """Stream the reply as the thinker would (started, a delta per token, text_done), leaving out
    the last ``lose`` events and event ``lose_seq``, then report the stage's end as the worker
    does. With ``replays`` it sends events again when the gateway asks, as a worker does; without,
    it is as if the worker had died meanwhile."""
    events = [ClientEvent(request_id=task.request_id, type=ClientEventType.STARTED)]
    events += [
        ClientEvent(request_id=task.request_id, type=ClientEventType.TEXT, text=t, token_ids=[i])
        for i, t in enumerate(TOKENS)
    ]
    usage = Usage(prompt_tokens=len(task.prompt_token_ids), completion_tokens=len(TOKENS))
    events.append(
        ClientEvent(
            request_id=task.request_id, type=ClientEventType.TEXT_DONE, finish_reason="length", usage=usage
        )
    )
    out = SUBJECTS.out(task.gateway_id, task.request_id)
    sent = [ev.replace(stage=0, replica=0, seq=seq).encode() for seq, ev in enumerate(events)]

    async def replay(msg) -> None:
        ask = decode(ReplayAsk, msg.data)
        await msg.respond(Replay(known=True, events=sent[ask.from_seq : ask.to_seq]).encode())

    if replays:
        await nc.subscribe(SUBJECTS.replay(0, 0), cb=replay)
    for seq, data in enumerate(sent[: len(events) - lose]):
        if seq != lose_seq:
            await nc.publish(out, data)
    ended = LifecycleEvent(
        request_id=task.request_id,
        kind="finished",
        ts_ns=time.time_ns(),
        stage=0,
        replica=0,
        started_ns=time.time_ns(),
        finish_reason="length",
        usage=usage,
        client_events=len(events),
    )
    await publish_lifecycle(nc.jetstream(), SUBJECTS, ended)
    return usage


async def test_a_lost_text_done_is_made_from_the_stages_end_notice(services, nats_server) -> None:
    base_url, gateway = services
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with played_worker(nats_server.url, PIPELINE, 0) as (nc, tasks):
        stream = await_stream(client)
        task = await asyncio.wait_for(tasks.get(), 10)
        usage = await play(nc, task, lose=1, replays=False)
        chunks = await asyncio.wait_for(stream, AT_ONCE_S)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(TOKENS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    await gateway.await_log(
        f"request {task.request_id}: ", "never arrived; the stream ends with text_done", timeout_s=5
    )
    await client.close()


async def test_lost_content_at_the_end_is_a_clear_error(services, nats_server) -> None:
    base_url, gateway = services
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with played_worker(nats_server.url, PIPELINE, 0) as (nc, tasks):
        stream = await_stream(client)
        task = await asyncio.wait_for(tasks.get(), 10)
        await play(nc, task, lose=2, replays=False)  # the last delta and the text_done
        with pytest.raises(openai.APIError) as e:
            await asyncio.wait_for(stream, AT_ONCE_S)
    assert "events_lost" in str(e.value.body or e.value.message)
    await gateway.await_log(
        f"request {task.request_id}: ", "never arrived; the stream ends with events_lost", timeout_s=5
    )
    await client.close()


def await_stream(client: openai.AsyncOpenAI) -> asyncio.Task[list]:
    """A streamed chat completion read to its end, in the background."""

    async def read() -> list:
        stream = await client.chat.completions.create(
            model=f"{PIPELINE}-model",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=len(TOKENS),
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]

    return asyncio.create_task(read())


async def test_an_event_lost_in_the_middle_is_sent_again_by_its_sender(services, nats_server) -> None:
    """The second delta never arrives; the gateway holds the later events, asks the thinker to
    send it again, and the client gets the whole reply in order."""
    base_url, gateway = services
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with played_worker(nats_server.url, PIPELINE, 0) as (nc, tasks):
        stream = await_stream(client)
        task = await asyncio.wait_for(tasks.get(), 10)
        await play(nc, task, lose=0, lose_seq=2)
        chunks = await asyncio.wait_for(stream, 10)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(TOKENS)
    await gateway.await_log(
        f"request {task.request_id}: ", "lost event(s) of stage 0 attempt 1 sent again", timeout_s=5
    )
    await client.close()


async def test_lost_last_events_are_sent_again_by_their_sender(services, nats_server) -> None:
    base_url, gateway = services
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with played_worker(nats_server.url, PIPELINE, 0) as (nc, tasks):
        stream = await_stream(client)
        task = await asyncio.wait_for(tasks.get(), 10)
        usage = await play(nc, task, lose=2)  # the last delta and the text_done
        chunks = await asyncio.wait_for(stream, 10)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(TOKENS)
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    await gateway.await_log(
        f"request {task.request_id}: ",
        "the last 2 event(s) of stage 0 attempt 1 were sent again",
        timeout_s=5,
    )
    await client.close()
