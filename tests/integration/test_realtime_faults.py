"""Realtime sessions through process deaths: a talker replica killed while a response is being
spoken, and an orchestrator killed during a session. Real processes: a listener with its Whisper
model, a mock thinker, two tiny talker replicas, code2wav, two orchestrators, a gateway, nats-server;
the official ``openai`` realtime client. Each fault is proved (the process is gone) before the
session is judged: the response completes with every thinker token spoken exactly once (its audio
as long as its tokens make), and the session takes its next turn."""

from __future__ import annotations

import asyncio
import base64
import functools
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from libs.common.pipeline import load_pipeline
from libs.stack.bus_state import snapshot
from libs.stack.local_nats import free_port
from tests.procs import (
    CODE2WAV_YAML,
    LISTENER_YAML,
    TALKER_YAML,
    ServiceProcess,
    kill_confirmed,
    mock_thinker_yaml,
    start_service,
    until,
    write_pipeline,
)
from tests.realtime_events import until_event

pytestmark = pytest.mark.integration

PIPELINE = "rtfault"
STAGES_YAML = (
    LISTENER_YAML
    + mock_thinker_yaml(inter_token_ms=5)
    + TALKER_YAML.replace(
        "    consumes: text\n", "    replicas: 2\n    stall_timeout_s: 5\n    consumes: text\n"
    )
    + CODE2WAV_YAML
)
TALKER = 2
SAMPLES_PER_TOKEN = 4 * 480
TOKENS = 160
"""Thinker tokens of each answer: about 15 s of audio, so the talker is still speaking it when
it is killed."""
EVENT_TIMEOUT_S = 120.0


@dataclass
class Stack:
    base_url: str
    nats_url: str
    talkers: list[ServiceProcess]
    orchestrators: list[ServiceProcess]


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("rtfault")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML)
    port = free_port()

    def worker(stage: int, replica: int = 0) -> ServiceProcess:
        env = {"OMNIRELAY_STAGE": str(stage), "OMNIRELAY_REPLICA": str(replica)}
        return start_service(["worker"], nats_server.url, path, tmp / f"w{stage}{replica}.log", env)

    orchestrators = [
        start_service(["orchestrator"], nats_server.url, path, tmp / f"o{i}.log") for i in (0, 1)
    ]
    gateway = start_service(["gateway", "--port", str(port)], nats_server.url, path, tmp / "gw.log")
    talkers = [worker(TALKER, r) for r in (0, 1)]
    others = [worker(0), worker(1), worker(3)]
    procs = [*orchestrators, *talkers, *others]
    try:
        base = f"http://127.0.0.1:{port}"

        def live() -> bool:
            try:
                r = httpx.get(f"{base}/health", timeout=2.0)
                return r.status_code == 200 and r.json()["stages"]["2:talker"] == 2
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        asyncio.run(until(live, "every stage live behind the gateway", timeout_s=180))
        yield Stack(base, nats_server.url, talkers, orchestrators)
    finally:
        for proc in procs:
            if proc.proc is not None and proc.proc.poll() is None:
                proc.stop()
        assert gateway.stop() in (0, -signal.SIGTERM)


_until = functools.partial(until_event, timeout_s=EVENT_TIMEOUT_S)
"""The next event of a kind (:func:`tests.realtime_events.until_event`)."""


async def _ask(conn, text: str) -> None:
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await conn.response.create(response={"max_output_tokens": TOKENS})


def _whole(events: list, done) -> None:
    """The response completed and every thinker token was spoken exactly once."""
    assert done.response.status == "completed", done.response.status_details
    audio = sum(len(base64.b64decode(e.delta)) for e in events if e.type == "response.output_audio.delta")
    assert done.response.usage.output_tokens == TOKENS
    assert audio == 2 * TOKENS * SAMPLES_PER_TOKEN, (audio, 2 * TOKENS * SAMPLES_PER_TOKEN)


async def _talker_of_the_response(stack: Stack) -> int:
    """The talker replica the one response under way is bound to (its record, in flight)."""
    pipeline = load_pipeline(stack.talkers[0].env["OMNIRELAY_PIPELINE"])

    async def bound() -> int | None:
        recs = (await snapshot(stack.nats_url, pipeline))["inflight"]
        speaking = [r for r in recs if r["entry_stage"] == 1 and r["stages"][TALKER]["started_ns"]]
        return speaking[0]["route"][TALKER] if len(speaking) == 1 else None

    async with asyncio.timeout(30):
        while (replica := await bound()) is None:
            await asyncio.sleep(0.05)
    return replica


def _client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


async def test_a_talker_killed_mid_answer_moves_and_the_answer_is_whole(stack) -> None:
    async with _client(stack).realtime.connect(model=f"{PIPELINE}-model") as conn:
        await _until(conn, "session.created")
        await _ask(conn, "Tell me a long story.")
        events: list = []
        await _until(conn, "response.output_audio.delta", events)
        victim = await _talker_of_the_response(stack)
        proc = stack.talkers[victim].proc
        assert proc is not None
        await kill_confirmed(proc.pid, f"talker replica {victim}")
        done = await _until(conn, "response.done", events)
        _whole(events, done)
        # the session goes on: a second turn is answered whole by the live talker
        await _ask(conn, "And then?")
        events = []
        _whole(events, await _until(conn, "response.done", events))


async def test_an_orchestrator_killed_during_a_session_and_the_session_goes_on(stack) -> None:
    async with _client(stack).realtime.connect(model=f"{PIPELINE}-model") as conn:
        await _until(conn, "session.created")
        await _ask(conn, "Hello.")
        events: list = []
        await _until(conn, "response.output_audio.delta", events)
        victim = stack.orchestrators[0].proc
        assert victim is not None
        await kill_confirmed(victim.pid, "an orchestrator")
        _whole(events, await _until(conn, "response.done", events))
        await _ask(conn, "Are you still there?")
        events = []
        _whole(events, await _until(conn, "response.done", events))
