"""The realtime messages against OpenAI's own definitions: every server event omnirelay sends
validates as the ``openai`` package's ``RealtimeServerEvent`` (field names, types, literals), the
events that package's client sends parse here, and a bad client event names what is wrong."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from services.gateway.realtime import responses
from services.gateway.realtime.protocol import (
    AudioAppend,
    BadEvent,
    Content,
    Item,
    ResponseCreate,
    Session,
    SessionUpdate,
    error_event,
    parse_client_event,
    server_event,
)
from services.gateway.realtime.responses import Response, ResponsePlan

OPENAI = TypeAdapter(RealtimeServerEvent)


def _valid(event: dict) -> None:
    parsed = OPENAI.validate_python(json.loads(json.dumps(event)))
    assert parsed.type == event["type"]


def test_session_and_conversation_events_are_openais_shape() -> None:
    session = Session(model="m")
    _valid(server_event("session.created", session=session.shown()))
    pcmu = session.updated(
        {"audio": {"output": {"format": {"type": "audio/pcmu"}}}, "output_modalities": ["text"]}
    )
    assert pcmu.audio.output.format.type == "audio/pcmu" and pcmu.audio.input.format.type == "audio/pcm"
    assert pcmu.id == session.id
    _valid(server_event("session.updated", session=pcmu.shown()))
    user = Item(role="user", content=[Content(type="input_audio", audio="AAAA", transcript="hi")])
    assert "audio" not in user.shown()["content"][0], "input audio is never sent back"
    for kind in ("conversation.item.added", "conversation.item.done"):
        _valid(server_event(kind, previous_item_id=None, item=user.shown()))
    _valid(server_event("conversation.item.retrieved", item=user.shown()))
    _valid(server_event("conversation.item.deleted", item_id=user.id))
    _valid(server_event("conversation.item.truncated", item_id=user.id, content_index=0, audio_end_ms=10))
    _valid(server_event("input_audio_buffer.speech_started", audio_start_ms=5, item_id=user.id))
    _valid(server_event("input_audio_buffer.speech_stopped", audio_end_ms=9, item_id=user.id))
    _valid(server_event("input_audio_buffer.committed", previous_item_id=None, item_id=user.id))
    _valid(server_event("input_audio_buffer.cleared"))
    _valid(
        server_event(
            "conversation.item.input_audio_transcription.completed",
            item_id=user.id,
            content_index=0,
            transcript="hi",
            usage={"type": "duration", "seconds": 1.0},
        )
    )
    bad = BadEvent("nope", "item_not_found", "item_id")
    bad.event_id = "evt_1"
    _valid(error_event(bad))


@pytest.mark.parametrize("audio", [True, False])
def test_a_response_s_events_are_openais_shape(audio: bool) -> None:
    sent: list[dict] = []

    async def send(event: dict) -> None:
        sent.append(event)

    r = Response(ResponsePlan(audio=audio, output_format="audio/pcm", voice="alloy", max_output_tokens="inf"))
    r.text, r.usage = ["Hello", " there"], responses._usage(7, 2)
    _valid(server_event("response.created", response=r.shown("in_progress")))
    asyncio.run(responses.conclude(r, send, "cancelled", {"type": "cancelled", "reason": "turn_detected"}))
    for event in sent:
        _valid(event)
    done = sent[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "cancelled"
    assert done["response"]["output"][0]["status"] == "incomplete"
    assert done["response"]["usage"]["total_tokens"] == 9


def test_the_clients_events_parse() -> None:
    assert isinstance(
        parse_client_event('{"type": "input_audio_buffer.append", "audio": "AAAA"}'), AudioAppend
    )
    update = parse_client_event(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
    assert isinstance(update, SessionUpdate)
    create = parse_client_event(json.dumps({"type": "response.create", "event_id": "x"}))
    assert isinstance(create, ResponseCreate) and create.event_id == "x"


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        ("[", "invalid_json", None),
        ('{"type": "bogus"}', "invalid_event_type", "type"),
        ('{"audio": "AAAA"}', "invalid_event_type", "type"),
        (
            '{"type": "conversation.item.truncate", "item_id": "i", "content_index": -1, "audio_end_ms": 0}',
            "invalid_value",
            "content_index",
        ),
    ],
)
def test_a_bad_client_event_says_what_is_wrong(raw: str, code: str, param: str | None) -> None:
    with pytest.raises(BadEvent) as e:
        parse_client_event(raw)
    assert (e.value.code, e.value.param) == (code, param)


@pytest.mark.parametrize(
    "patch",
    [
        {"output_modalities": ["text", "audio"]},
        {"tools": [{"type": "function", "name": "f"}]},
        {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
        {"audio": {"output": {"format": {"type": "audio/ogg"}}}},
        {"max_output_tokens": 0},
    ],
)
def test_a_session_this_server_cannot_serve_is_refused(patch: dict) -> None:
    with pytest.raises(ValueError):
        Session(model="m").updated(patch)
