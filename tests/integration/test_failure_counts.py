"""Every way a request fails is counted under its reason in ``vllm:omni_requests_failed_total``
and never as an abort; a client that leaves is an abort (``vllm:omni_requests_success_total
{finished_reason="abort"}``) and no failure; an audio request that ends without audio is counted in
``vllm:omni_audio_skipped_requests_total`` under why. Each failure is caused for real: a real
gateway, orchestrator and code2wav worker; the test plays the thinker and the talker (registered,
answering their probes, as ``tests/bus.played_worker``) and, for the codec rejection, sends the
out-of-range codes a real talker cannot produce (it samples only codes in range)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from libs.common.envelopes import ClientEvent, ClientEventType, NdArray, StageTask, TaskKind, Usage
from libs.common.publish import Hop, publish_task
from libs.common.subjects import Subjects
from tests.bus import played_worker
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import CODE2WAV_YAML, TALKER_YAML, THINKER_YAML, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "failcount"
SUBJECTS = Subjects(PIPELINE)
MODEL = f"{PIPELINE}-model"
TIMEOUT_S = 3.0
"""The pipeline's request timeout (the timeout case waits for it)."""
CLIENT_TIMEOUT_S = 30.0
"""The client's own timeout, seconds: far past the pipeline's."""
FAILED, SUCCESS, SKIPPED = (
    "vllm:omni_requests_failed_total",
    "vllm:omni_requests_success_total",
    "vllm:omni_audio_skipped_requests_total",
)
AUDIO = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """A real orchestrator, gateway and code2wav worker (the test plays the thinker and talker)."""
    tmp = tmp_path_factory.mktemp("failcount")
    path = write_pipeline(
        tmp / "p.yaml", PIPELINE, THINKER_YAML + TALKER_YAML + CODE2WAV_YAML, timeout_s=TIMEOUT_S
    )
    with Services(nats_server.url, path, tmp).start(workers=[(2, 0)]).serving() as services:
        yield services


async def counted(stack: Services, before: dict, name: str, want: float, **labels: str) -> dict:
    """The gateway's counters once ``name{labels}`` has moved by ``want`` since ``before`` (the
    gateway records a request as its response ends, a moment after the client has it)."""
    for _ in range(50):
        after = scrape(stack.metrics_url)
        if delta(before, after, name, **labels) >= want:
            return after
        await asyncio.sleep(0.1)
    return after


def assert_failed_once_as(before: dict, after: dict, reason: str) -> None:
    """Exactly one failure, under ``reason``, and no abort."""
    assert delta(before, after, FAILED, reason=reason) == 1, reason
    assert delta(before, after, FAILED) == 1, "another reason moved too"
    assert delta(before, after, SUCCESS) == 0, "a failure was counted as a success or an abort"


async def answer_as_thinker(nc, task: StageTask, events: list[ClientEvent], every_s: float = 0.0) -> None:
    """Send ``events`` to the request's gateway as thinker replica 0's first attempt does, one
    every ``every_s`` seconds."""
    out = SUBJECTS.out(task.gateway_id, task.request_id)
    for seq, ev in enumerate(events):
        await nc.publish(out, ev.replace(stage=0, replica=0, seq=seq).encode())
        await asyncio.sleep(every_s)


def reply(task: StageTask) -> list[ClientEvent]:
    """A one-token reply, as the thinker streams it."""
    rid = task.request_id
    return [
        ClientEvent(request_id=rid, type=ClientEventType.STARTED),
        ClientEvent(request_id=rid, type=ClientEventType.TEXT, text="Hi", token_ids=[7]),
        ClientEvent(
            request_id=rid,
            type=ClientEventType.TEXT_DONE,
            finish_reason="length",
            usage=Usage(prompt_tokens=len(task.prompt_token_ids), completion_tokens=1),
        ),
    ]


def code_chunk(task: StageTask, codes: list[int]) -> StageTask:
    """The talker's last (and only) code chunk of ``task``'s request."""
    return StageTask(
        request_id=task.request_id,
        gateway_id=task.gateway_id,
        arrival_ns=task.arrival_ns,
        deadline_ns=task.deadline_ns,
        route=task.route,
        kind=TaskKind.CHUNK,
        seq=0,
        final=True,
        codes=NdArray.of(np.asarray(codes, dtype=np.int32)),
    )


async def test_no_live_replica(stack, nats_server) -> None:
    before = scrape(stack.metrics_url)
    with pytest.raises(openai.APIStatusError) as e:
        await stack.client(CLIENT_TIMEOUT_S).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert (e.value.status_code, e.value.code) == (503, "no_live_replica")
    assert_failed_once_as(before, await counted(stack, before, FAILED, 1), "no_live_replica")


async def test_timeout(stack, nats_server) -> None:
    async with played_worker(nats_server.url, PIPELINE, 0) as (_, tasks):
        before = scrape(stack.metrics_url)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:  # the thinker takes the task and says nothing
            await stack.client(CLIENT_TIMEOUT_S).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert tasks.qsize() == 1, "the request never reached the thinker"
    assert (e.value.status_code, e.value.code) == (504, "timeout")
    # at the request's deadline: not before it, and long before the client's own 30 s
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 5
    assert_failed_once_as(before, await counted(stack, before, FAILED, 1), "timeout")


async def test_stage_error(stack, nats_server) -> None:
    async with played_worker(nats_server.url, PIPELINE, 0) as (nc, tasks):
        before = scrape(stack.metrics_url)
        call = asyncio.create_task(
            stack.client(CLIENT_TIMEOUT_S).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        )
        task = await asyncio.wait_for(tasks.get(), 10)
        error = ClientEvent(
            request_id=task.request_id,
            type=ClientEventType.ERROR,
            status=500,
            code="stage_error",
            message="stage 0 (thinker) failed: the engine raised",
        )
        await answer_as_thinker(nc, task, [error])
        with pytest.raises(openai.APIStatusError) as e:
            await call
    assert (e.value.status_code, e.value.code) == (500, "stage_error")
    assert_failed_once_as(before, await counted(stack, before, FAILED, 1), "stage_error")


async def audio_request_whose_talker_sends(
    stack: Services, url: str, codes: list[int]
) -> tuple[dict, asyncio.Task]:
    """An audio request that the played thinker answers with one token and the played talker
    with one last code chunk of ``codes`` for the real code2wav: the gateway's counters before it,
    and the client's finished call."""
    async with (
        played_worker(url, PIPELINE, 0) as (nc, tasks),
        played_worker(url, PIPELINE, 1),
    ):
        before = scrape(stack.metrics_url)
        call = asyncio.create_task(
            stack.client(CLIENT_TIMEOUT_S).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, **AUDIO
            )
        )
        task = await asyncio.wait_for(tasks.get(), 10)
        await answer_as_thinker(nc, task, reply(task))
        await publish_task(nc.jetstream(), SUBJECTS, code_chunk(task, codes), Hop("1", "0", 2, 0))
        await asyncio.wait([call], timeout=30)
    return before, call


async def test_codec_rejection_is_a_failure_and_a_skipped_audio_request(stack, nats_server) -> None:
    before, call = await audio_request_whose_talker_sends(stack, nats_server.url, [5, 1 << 20])
    with pytest.raises(openai.APIStatusError) as e:
        call.result()
    assert (e.value.status_code, e.value.code) == (500, "codec_input_rejected")
    after = await counted(stack, before, SKIPPED, 1, reason="codec_input_rejected")
    assert_failed_once_as(before, after, "codec_input_rejected")
    assert delta(before, after, SKIPPED, reason="codec_input_rejected", stage="2", replica="0") == 1
    assert delta(before, after, SKIPPED) == 1


async def test_an_audio_request_that_ends_without_audio_is_skipped_not_failed(stack, nats_server) -> None:
    before, call = await audio_request_whose_talker_sends(stack, nats_server.url, [])
    response = call.result()
    audio = response.choices[0].message.audio
    assert (audio.transcript, audio.data) == ("Hi", ""), "the text came, the audio is empty"
    after = await counted(stack, before, SKIPPED, 1, reason="no_audio_data")
    assert delta(before, after, SKIPPED, reason="no_audio_data", stage="2", replica="0") == 1
    assert delta(before, after, SKIPPED) == 1
    assert delta(before, after, FAILED) == 0
    assert delta(before, after, SUCCESS, finished_reason="length") == 1


async def test_a_client_that_leaves_is_an_abort_not_a_failure(stack, nats_server) -> None:
    async with played_worker(nats_server.url, PIPELINE, 0) as (nc, tasks):
        before = scrape(stack.metrics_url)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:

            async def read_and_leave() -> list[str]:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    return [line async for line in _first(r.aiter_lines(), 3)]  # then it closes

            reading = asyncio.create_task(read_and_leave())
            task = await asyncio.wait_for(tasks.get(), 10)
            rid = task.request_id
            events = [ClientEvent(request_id=rid, type=ClientEventType.STARTED)] + [
                ClientEvent(request_id=rid, type=ClientEventType.TEXT, text=" tick", token_ids=[i])
                for i in range(40)
            ]
            streaming = asyncio.create_task(answer_as_thinker(nc, task, events, every_s=0.05))
            got = await asyncio.wait_for(reading, 10)
            assert all(line.startswith("data: {") for line in got), got
            after = await counted(stack, before, SUCCESS, 1, finished_reason="abort")
            streaming.cancel()
    assert delta(before, after, SUCCESS, finished_reason="abort") == 1
    assert delta(before, after, SUCCESS) == 1
    assert delta(before, after, FAILED) == 0


async def _first(lines, n: int):
    """The first ``n`` non-empty lines."""
    seen = 0
    async for line in lines:
        if line:
            yield line
            seen += 1
            if seen == n:
                return
