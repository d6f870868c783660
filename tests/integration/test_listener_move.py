"""A listener replica killed mid-utterance: two real listener workers (the real Whisper model), a
mock thinker, a real gateway, orchestrator and nats-server. A long spoken passage is streamed to
``/v1/audio/transcriptions``; once the request's record binds a listener and that replica has the
request, it is killed (and shown gone). The request moves to the other replica, and the client's
transcript is the one the fault-free run gave, every segment once: nothing heard twice or lost."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import pytest

from libs.stack.bus_state import request_record
from libs.stack.processes import until
from tests.pipeline_services import Services
from tests.procs import LISTENER_YAML, kill_confirmed, mock_thinker_yaml, write_pipeline
from tests.speech import recall, spoken

pytestmark = pytest.mark.integration

PIPELINE = "lmove"
STAGES_YAML = (
    LISTENER_YAML.replace("    consumes: audio\n", "    replicas: 2\n    consumes: audio\n")
    + mock_thinker_yaml()
)
PASSAGE = (
    "The harbour was quiet before dawn. Fishing boats rocked on the grey water, and the gulls "
    "waited on the wall. An old man walked along the pier with a lantern in his hand. He stopped "
    "at the last boat and looked out to sea. The wind was rising from the west, and the clouds "
    "were low and heavy. He knew that the storm would come before noon."
)


@pytest.fixture(scope="module")
def stack(nats_server, tmp_path_factory) -> Iterator[Services]:
    """Two real listeners, a mock thinker, a real orchestrator and gateway."""
    tmp = tmp_path_factory.mktemp("lmove")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML)
    with Services(nats_server.url, path, tmp).start(workers=[(0, 0), (0, 1), (1, 0)]).serving() as services:
        yield services


def _form(wav: bytes, stream: bool) -> tuple[dict, dict]:
    data = {"model": f"{PIPELINE}-model", "stream": "true" if stream else "false"}
    return data, {"file": ("passage.wav", io.BytesIO(wav), "audio/wav")}


async def test_a_listener_killed_mid_utterance_moves_and_nothing_is_heard_twice(stack, tmp_path) -> None:
    wav = spoken(PASSAGE, tmp_path / "passage.wav").read_bytes()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        data, files = _form(wav, stream=False)
        reference = (await http.post("/v1/audio/transcriptions", data=data, files=files)).json()["text"]
        assert recall(reference, PASSAGE) >= 0.7, reference

        data, files = _form(wav, stream=True)
        async with http.stream("POST", "/v1/audio/transcriptions", data=data, files=files) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            record = await until(lambda: request_record(stack.nats_url, rid), "the request's record", 10)
            victim = stack.worker(0, record["route"][0])
            assert victim.proc is not None
            await kill_confirmed(victim.proc.pid, f"listener replica {record['route'][0]}")
            events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    (done,) = [e for e in events if e["type"] == "transcript.text.done"]
    assert "".join(deltas) == done["text"] == reference, "every segment once, as the fault-free run heard it"
    moved = await request_record(stack.nats_url, rid)
    attempts = moved["stages"][0]["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2], attempts
    assert attempts[1]["replica"] != attempts[0]["replica"], "the move went to the other listener"
