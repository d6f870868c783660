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
from collections.abc import Iterator

import pytest

from libs.stack.bus_state import snapshot
from tests.pipeline_services import Services
from tests.procs import (
    CODE2WAV_YAML,
    LISTENER_YAML,
    TALKER_YAML,
    kill_confirmed,
    mock_thinker_yaml,
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


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """Two real orchestrators, a gateway, a listener, a mock thinker, two talkers and code2wav."""
    tmp = tmp_path_factory.mktemp("rtfault")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML)
    workers = [(TALKER, 0), (TALKER, 1), (0, 0), (1, 0), (3, 0)]
    with Services(nats_server.url, path, tmp).start(orchestrators=2, workers=workers).serving() as services:
        yield services


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


async def _talker_of_the_response(stack: Services) -> int:
    """The talker replica the one response under way is bound to (its record, in flight)."""

    async def bound() -> int | None:
        recs = (await snapshot(stack.nats_url, stack.config))["inflight"]
        speaking = [r for r in recs if r["entry_stage"] == 1 and r["stages"][TALKER]["started_ns"]]
        return speaking[0]["route"][TALKER] if len(speaking) == 1 else None

    async with asyncio.timeout(30):
        while (replica := await bound()) is None:
            await asyncio.sleep(0.05)
    return replica


async def test_a_talker_killed_mid_answer_moves_and_the_answer_is_whole(stack) -> None:
    async with stack.client().realtime.connect(model=f"{PIPELINE}-model") as conn:
        await _until(conn, "session.created")
        await _ask(conn, "Tell me a long story.")
        events: list = []
        await _until(conn, "response.output_audio.delta", events)
        victim = await _talker_of_the_response(stack)
        proc = stack.worker(TALKER, victim).proc
        assert proc is not None
        await kill_confirmed(proc.pid, f"talker replica {victim}")
        done = await _until(conn, "response.done", events)
        _whole(events, done)
        # the session goes on: a second turn is answered whole by the live talker
        await _ask(conn, "And then?")
        events = []
        _whole(events, await _until(conn, "response.done", events))


async def test_an_orchestrator_killed_during_a_session_and_the_session_goes_on(stack) -> None:
    async with stack.client().realtime.connect(model=f"{PIPELINE}-model") as conn:
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
