"""The gateway's documented answers when the pipeline cannot take a request (docs/api.md, "Errors", and
``GET /health``), each caused for real and judged through the official ``openai`` client:

- 429 ``queue_full``: the admission queue (stream ``OMNI_<P>_REQUESTS``, bounded by the broker's
  ``max_msgs``) is full;
- 503 ``bus_unavailable``: the broker is gone (a real nats-server killed, its pid proven gone);
- 503 ``replica_lost``: a request's replica died and its gateway did not answer the move (a real
  gateway stopped with ``SIGSTOP``, its state proven ``T``);
- ``/health`` 503 ``unavailable`` while a stage has no live replica or the bus is down.

A stack of its own (the broker is killed here): a nats-server, a real orchestrator and a real
gateway of a thinker-only pipeline with two replicas. No engine is needed for these paths: the
test plays the thinker replicas (``tests/bus.played_worker``: registered, answering probes; one
"dies" by closing its connection, which is what a ``kill -9`` does to a worker's connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import nats
import openai
import pytest
from nats.js.errors import NotFoundError

from libs.common.envelopes import Admission, decode
from libs.common.subjects import Subjects
from libs.stack.bus_state import barrier, request_record
from libs.stack.processes import until
from tests.bus import played_worker
from tests.conftest import NatsServer
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, ServiceProcess, gone, stop_confirmed, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "errpaths"
SUBJECTS = Subjects(PIPELINE)
MODEL = f"{PIPELINE}-model"
STAGE = "0:thinker"
FAILED = "vllm:omni_requests_failed_total"
ERROR_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}
"""The ``type`` of the gateway's error body per status (docs/api.md: OpenAI's error shape)."""
CLIENT_TIMEOUT_S = 60.0
"""The client's own timeout per request, seconds."""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """The module's own nats-server (a test kills it)."""
    server = NatsServer(tmp_path_factory.mktemp("errpaths") / "jetstream")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(broker: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    """A real orchestrator and gateway; the tests play the thinker replicas."""
    tmp = tmp_path_factory.mktemp("errpaths")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, THINKER_YAML.replace("replicas: 1", "replicas: 2"), 60.0)
    with Services(broker.url, path, tmp).start().serving() as services:
        yield services


def ask(client: openai.AsyncOpenAI, text: str = "hi"):
    """A non-streamed chat request (a coroutine)."""
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3
    )


def assert_openai_error(e: openai.APIStatusError, status: int, code: str) -> None:
    """``e`` is the HTTP ``status`` with OpenAI's error body: message, type, param, code."""
    assert e.status_code == status, e
    err = e.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert (err["type"], err["code"]) == (ERROR_TYPES[status], code), err
    assert (e.type, e.code) == (err["type"], err["code"])  # what the openai client makes of it


async def health(stack: Services) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.get(f"{stack.base_url}/health")


async def bus_is(stack: Services, connected: bool) -> bool:
    """Whether the gateway's ``/health`` says its connection to the bus is (``connected``) up."""
    return (await health(stack)).json()["bus"] is connected


async def health_until(stack: Services, status: int, timeout_s: float = 15.0) -> dict:
    """The body of ``/health`` once it answers ``status`` (the gateway's registry view follows
    the registrations within its watch's delay)."""

    async def answered() -> dict | None:
        r = await health(stack)
        return r.json() if r.status_code == status else None

    return await until(answered, f"/health answering {status}", timeout_s, every_s=0.1)


@contextlib.asynccontextmanager
async def stopped(proc: ServiceProcess, what: str) -> AsyncIterator[int]:
    """``proc`` stopped (``SIGSTOP``, its state checked) while the block runs; its pid."""
    assert proc.proc is not None
    pid = proc.proc.pid
    try:
        await stop_confirmed(pid, what)
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


async def queued(url: str) -> int:
    """Messages in the admission queue, as the broker counts them."""
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(SUBJECTS.requests_stream)).state.messages
    finally:
        await nc.close()


async def test_health_is_503_unavailable_without_a_live_replica_of_a_stage_or_orchestrator(
    stack: Services,
) -> None:
    body = await health_until(stack, 503)
    assert body["status"] == "unavailable" and body["bus"] is True and body["orchestrators"] >= 1, body
    assert body["stages"] == {STAGE: 0}, body
    async with played_worker(stack.nats_url, PIPELINE, 0, 0):
        body = await health_until(stack, 200)
        assert (body["status"], body["stages"], body["degraded"]) == ("degraded", {STAGE: 1}, [STAGE])
        async with played_worker(stack.nats_url, PIPELINE, 0, 1):
            body = await health_until(stack, 200)
            assert (body["status"], body["stages"], body["degraded"]) == ("ok", {STAGE: 2}, [])
            async with stopped(stack.orchestrator, "the orchestrator"):
                # No heartbeat: its registration expires (TTL 6 s) and no orchestrator is live.
                body = await health_until(stack, 503)
                assert (body["status"], body["orchestrators"], body["stages"]) == (
                    "unavailable",
                    0,
                    {STAGE: 2},
                )
            body = await health_until(stack, 200)
            assert body["status"] == "ok" and body["orchestrators"] >= 1, body
    body = await health_until(stack, 503)  # both replicas left (deregistered)
    assert (body["status"], body["stages"]) == ("unavailable", {STAGE: 0}), body


async def test_a_full_admission_queue_is_429_queue_full(stack: Services) -> None:
    """The broker's own bound decides: with the queue one short of ``max_msgs`` a request is
    queued, the next one is refused with 429, and the queue holds exactly ``max_msgs``."""
    client = stack.client(CLIENT_TIMEOUT_S)
    nc = await nats.connect(stack.nats_url)
    js = nc.jetstream()
    admitted: asyncio.Task | None = None
    try:
        async with stopped(stack.orchestrator, "the orchestrator"):  # nobody drains the queue
            info = await js.stream_info(SUBJECTS.requests_stream)
            limit = info.config.max_msgs
            assert 0 < limit <= 100_000, f"the admission queue is not bounded: max_msgs={limit}"
            for _ in range(limit - 1 - info.state.messages):
                await nc.publish(SUBJECTS.requests, b"filler")  # stored: the subject is the stream's
            await barrier(nc)
            await until(lambda: _has(js, limit - 1), f"{limit - 1} messages queued")
            before = scrape(stack.metrics_url)
            admitted = asyncio.create_task(ask(client, "the last place in the queue"))
            await until(lambda: _has(js, limit), "the gateway queued the request")
            with pytest.raises(openai.RateLimitError) as e:
                await ask(client, "one too many")
            assert_openai_error(e.value, 429, "queue_full")
            assert (await js.stream_info(SUBJECTS.requests_stream)).state.messages == limit
            assert not admitted.done(), "the queued request was answered while nobody served it"
            assert delta(before, scrape(stack.metrics_url), FAILED, reason="queue_full") == 1
            await js.purge_stream(SUBJECTS.requests_stream)  # the orchestrator finds it empty
    finally:
        if admitted is not None:
            admitted.cancel()  # the client leaves: the gateway aborts it
        await nc.close()
        await client.close()


async def _has(js, n: int) -> bool:
    return (await js.stream_info(SUBJECTS.requests_stream)).state.messages == n


async def test_a_gateway_that_does_not_answer_a_move_fails_it_503_replica_lost(stack: Services) -> None:
    """A request's replica dies; the orchestrator asks the request's gateway where the client's
    stream stands to move it, gets no answer (the gateway is stopped) and fails it: the record
    says so, and the client, once its gateway runs again, gets 503 ``replica_lost``."""
    client = stack.client(CLIENT_TIMEOUT_S)
    url = stack.nats_url
    try:
        async with contextlib.AsyncExitStack() as r0, contextlib.AsyncExitStack() as r1:
            replicas = [
                await r0.enter_async_context(played_worker(url, PIPELINE, 0, 0)),
                await r1.enter_async_context(played_worker(url, PIPELINE, 0, 1)),
            ]
            await health_until(stack, 200)
            call = asyncio.create_task(ask(client, "move me"))
            gets = {asyncio.create_task(tasks.get()): r for r, (_, tasks) in enumerate(replicas)}
            done, pending = await asyncio.wait(gets, timeout=15, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            assert done, "the request reached no thinker replica"
            first = done.pop()
            task, bound = first.result(), gets[first]
            async with stopped(stack.gateway, "the gateway"):
                # The bound replica dies: its connection closes, NATS answers its probes with
                # "no responders", and the other replica is live to move the request to.
                conn = replicas[bound][0]
                await (r0 if bound == 0 else r1).aclose()
                assert conn.is_closed
                rec = await _record_until(url, task.request_id, lambda r: r["status"] == "failed")
                assert rec["error"] == "replica_lost", rec
                assert not call.done()
            with pytest.raises(openai.InternalServerError) as e:
                await asyncio.wait_for(call, 30)
            assert_openai_error(e.value, 503, "replica_lost")
            assert "gateway did not answer" in e.value.message
            assert e.value.request_id == task.request_id  # the failed request's record is found
    finally:
        await client.close()


async def _record_until(url: str, rid: str, cond: Callable[[dict], bool], timeout_s: float = 20.0) -> dict:
    """The request's ``omni_requests`` record once ``cond`` holds for it."""

    async def record() -> dict | None:
        rec = await request_record(url, rid)
        return rec if rec is not None and cond(rec) else None

    return await until(record, f"the record of {rid} as expected", timeout_s, every_s=0.1)


async def test_with_the_broker_gone_a_request_is_503_bus_unavailable_and_never_queued(
    stack: Services, broker: NatsServer
) -> None:
    """nats-server is killed (its pid gone): a request is answered 503 ``bus_unavailable``,
    ``/health`` says 503 ``unavailable`` with ``bus: false``; once the broker is back, the
    refused request was not queued after all (a client told 503 may send it again)."""
    client = stack.client(CLIENT_TIMEOUT_S)
    server = broker
    assert server.proc is not None
    marker: asyncio.Task | None = None
    try:
        async with stopped(stack.orchestrator, "the orchestrator"):  # the queue shows what came
            kept = await queued(server.url)
            before = scrape(stack.metrics_url)
            server.proc.send_signal(signal.SIGKILL)
            assert server.proc.wait(5) == -signal.SIGKILL and gone(server.proc.pid)
            await until(lambda: bus_is(stack, False), "the gateway saw the broker go")
            with pytest.raises(openai.InternalServerError) as e:
                await ask(client, "refused while the broker is away")
            assert_openai_error(e.value, 503, "bus_unavailable")
            body = (await health(stack)).json()
            assert (body["status"], body["bus"]) == ("unavailable", False), body
            assert (await health(stack)).status_code == 503
            assert delta(before, scrape(stack.metrics_url), FAILED, reason="bus_unavailable") == 1

            server.start()  # the same port and store
            await until(lambda: bus_is(stack, True), "the gateway reconnected")
            # A request sent now is queued behind anything the gateway still held from before.
            sent_ns = time.time_ns()
            marker = asyncio.create_task(ask(client, "sent after the broker came back"))

            async def marker_queued() -> list[Admission] | None:
                stored = await _admissions(server.url)
                return stored if any(a.arrival_ns >= sent_ns for a in stored) else None

            stored = await until(marker_queued, "the request sent after the restart queued")
            assert len(stored) == kept + 1, [(a.request_id, a.arrival_ns, sent_ns) for a in stored]
            await _purge(server.url)
    finally:
        if marker is not None:
            marker.cancel()
        if server.proc is None or server.proc.poll() is not None:
            server.start()  # the module's teardown stops the services through it
        await client.close()


async def _admissions(url: str) -> list[Admission]:
    """Every admission in the queue, oldest first."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(SUBJECTS.requests_stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(NotFoundError):
                out.append(decode(Admission, (await js.get_msg(SUBJECTS.requests_stream, seq)).data))
        return out
    finally:
        await nc.close()


async def _purge(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().purge_stream(SUBJECTS.requests_stream)
    finally:
        await nc.close()
