"""The Realtime API's messages, as OpenAI's GA API names them: the session's configuration, the
conversation's items, the events a client sends (validated here: a bad one is an ``error`` event
and the socket lives on) and the events the server sends (:func:`server_event`).

Only what omnirelay serves is accepted: ``server_vad`` turn detection (not ``semantic_vad``), no
tools, one output modality per response (``text`` or ``audio``, as OpenAI's GA API requires).
"""

from __future__ import annotations

import itertools
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

MAX_EVENT_BYTES = 16 << 20
"""Largest client event (WebSocket message) the server reads, bytes; a larger one closes the
socket (1009), as the server's frame limit does."""
MAX_INSTRUCTIONS_CHARS = 100_000


class _Open(BaseModel):
    """A message whose unknown fields are ignored (a newer client's)."""

    model_config = ConfigDict(extra="ignore")


# --- the session ----------------------------------------------------------------------------------
class AudioFormat(_Open):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: Literal[24000] | None = None
    """``audio/pcm`` only: 24 kHz, the one rate OpenAI takes."""

    def shown(self) -> dict[str, Any]:
        return {"type": self.type, "rate": 24000} if self.type == "audio/pcm" else {"type": self.type}


class ServerVad(_Open):
    """OpenAI's ``server_vad`` turn detection (services/gateway/voice_activity.py)."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(default=0.5, ge=0, le=1)
    prefix_padding_ms: int = Field(default=300, ge=0, le=10_000)
    silence_duration_ms: int = Field(default=500, ge=32, le=10_000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None


class InputTranscription(_Open):
    model: str | None = None
    language: str | None = Field(default=None, pattern=r"^[a-z]{2,3}$")
    prompt: str | None = Field(default=None, max_length=2000)


class AudioInput(_Open):
    format: AudioFormat = AudioFormat()
    transcription: InputTranscription | None = None
    turn_detection: ServerVad | None = ServerVad()
    noise_reduction: None = None


class AudioOutput(_Open):
    format: AudioFormat = AudioFormat()
    voice: str = "alloy"
    speed: float = Field(default=1.0, ge=0.25, le=1.5)


class SessionAudio(_Open):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


Modality = Literal["text", "audio"]


class Session(_Open):
    """A realtime session's configuration: what ``session.update`` changes and what
    ``session.created`` / ``session.updated`` show."""

    type: Literal["realtime"] = "realtime"
    object: Literal["realtime.session"] = "realtime.session"
    id: str = Field(default_factory=lambda: f"sess_{uuid.uuid4().hex[:24]}")
    model: str = ""
    output_modalities: list[Modality] = Field(default_factory=lambda: ["audio"], min_length=1, max_length=1)
    instructions: str = Field(default="", max_length=MAX_INSTRUCTIONS_CHARS)
    audio: SessionAudio = SessionAudio()
    max_output_tokens: int | Literal["inf"] = "inf"
    tools: list[Any] = Field(default_factory=list, max_length=0)
    tool_choice: str = "auto"
    tracing: None = None
    truncation: str = "auto"

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 4096:
            raise ValueError("max_output_tokens must be 1 to 4096 or 'inf'")
        return value

    def updated(self, patch: dict[str, Any]) -> Session:
        """This configuration with ``patch`` (a ``session.update``'s partial session) merged in;
        raises :class:`pydantic.ValidationError` when the result is not one this server serves."""
        merged = _merge(self.model_dump(), patch)
        merged["id"], merged["model"] = self.id, self.model  # neither changes within a session
        return Session.model_validate(merged)

    def shown(self) -> dict[str, Any]:
        out = self.model_dump()
        out["audio"]["input"]["format"] = self.audio.input.format.shown()
        out["audio"]["output"]["format"] = self.audio.output.format.shown()
        return out


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "turn_detection":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# --- conversation items -------------------------------------------------------------------------
class Content(_Open):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text"]
    text: str | None = None
    audio: str | None = None
    """``input_audio`` of ``conversation.item.create``: base64 audio in the session's input format."""
    transcript: str | None = None


class Item(_Open):
    """A conversation item: a message of the user, the assistant or the system."""

    id: str = Field(default_factory=lambda: f"item_{uuid.uuid4().hex[:24]}", max_length=64)
    type: Literal["message"] = "message"
    object: Literal["realtime.item"] = "realtime.item"
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    role: Literal["user", "assistant", "system"]
    content: list[Content] = Field(default_factory=list, max_length=16)

    def text(self) -> str:
        """What the item says, as text: typed text, or the transcript of its audio."""
        return "".join(c.text or c.transcript or "" for c in self.content)

    def shown(self) -> dict[str, Any]:
        """The item as events show it (input audio's bytes are never sent back)."""
        return self.model_dump(exclude_none=True, exclude={"content": {"__all__": {"audio"}}})


# --- client events --------------------------------------------------------------------------------
class _ClientEvent(_Open):
    event_id: str | None = Field(default=None, max_length=64)


class SessionUpdate(_ClientEvent):
    type: Literal["session.update"]
    session: dict[str, Any]


class AudioAppend(_ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(_ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_ClientEvent):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


class ItemDelete(_ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemTruncate(_ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseParams(_Open):
    """``response.create``'s per-response overrides of the session."""

    output_modalities: list[Modality] | None = Field(default=None, min_length=1, max_length=1)
    instructions: str | None = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    audio: SessionAudio | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    conversation: Literal["auto", "none"] = "auto"
    input: list[Item] | None = None
    metadata: dict[str, str] | None = None


class ResponseCreate(_ClientEvent):
    type: Literal["response.create"]
    response: ResponseParams = ResponseParams()


class ResponseCancel(_ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Annotated[
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel,
    Field(discriminator="type"),
]
_CLIENT_EVENT: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)


class BadEvent(Exception):
    """A client event this server cannot take; the client gets an ``error`` event with it."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.event_id: str | None = None


def parse_client_event(text: str | bytes) -> ClientEvent:
    """One client event from its JSON text, or :class:`BadEvent` saying what is wrong."""
    try:
        return _CLIENT_EVENT.validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"][1:]) or None
        kind = first["type"]
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            raise BadEvent(
                f"unknown or missing event type: {first['msg']}", "invalid_event_type", "type"
            ) from None
        if kind == "json_invalid":
            raise BadEvent("the event is not valid JSON", "invalid_json") from None
        raise BadEvent(
            f"{where}: {first['msg']}" if where else first["msg"], "invalid_value", where
        ) from None


# --- server events --------------------------------------------------------------------------------
_event_numbers = itertools.count(1)


def server_event(type_: str, **fields: Any) -> dict[str, Any]:
    """A server event: its ``type``, a fresh ``event_id`` and ``fields``."""
    return {"type": type_, "event_id": f"event_{next(_event_numbers)}_{uuid.uuid4().hex[:8]}", **fields}


def error_event(e: BadEvent) -> dict[str, Any]:
    """The ``error`` event of a client event that could not be taken."""
    error = {"type": "invalid_request_error", "code": e.code, "message": e.message, "param": e.param}
    return server_event("error", error={**error, "event_id": e.event_id})
