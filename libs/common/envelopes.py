"""Message bodies on the bus: pydantic models encoded with msgpack.

Arrays travel as raw bytes with dtype and shape (:class:`NdArray`). Decoding validates the body,
so a malformed message raises :class:`MalformedMessage` (the receiver terminates it). Every body
is a map of the model's fields, but for the hot one, a ``text`` :class:`ClientEvent` (one per
streamed token), which the worker sends as an array (:data:`TEXT_LAYOUT`).
Times are wall-clock ns (``time.time_ns()``) unless a field says otherwise.
"""

from __future__ import annotations

import logging
import re
from enum import StrEnum
from typing import Annotated, Literal, Self, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError


class MalformedMessage(ValueError):
    """A bus message that cannot be used; ``reason`` is a short code for metrics."""

    def __init__(self, message: str, reason: str = "invalid_envelope") -> None:
        super().__init__(message)
        self.reason = reason


MAX_ID_CHARS = 128
"""Longest request or gateway id a message may carry (the gateway's are 40-odd characters)."""
Id = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]+$", max_length=MAX_ID_CHARS)]
"""A request or gateway id: one NATS subject token and KV key (``subjects.check_token``). Services
put these ids into subjects (``out.<gateway>.<request>``) and KV keys; one with a space, a dot or
a wildcard, or longer than the server's control line, would make the server close the publishing
connection (found by the bus fuzzer, tests/e2e/test_fuzz_bus.py), so a message carrying one is
malformed."""


_ID = re.compile(f"[A-Za-z0-9_-]{{1,{MAX_ID_CHARS}}}")
"""A valid :data:`Id`, for the checks made without pydantic (:func:`plain_text`)."""


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def encode(self) -> bytes:
        """msgpack bytes of this envelope."""
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @classmethod
    def from_body(cls, raw: object) -> Self:
        """Validate an unpacked body or raise :class:`MalformedMessage` saying why."""
        if not isinstance(raw, dict):
            raise MalformedMessage(f"body must be a map, got {type(raw).__name__}", "not_a_map")
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise MalformedMessage(f"not a valid {cls.__name__}: {e.errors()[0]['msg']}") from None


E = TypeVar("E", bound=_Envelope)


def unpack(data: bytes) -> object:
    """The msgpack value of ``data`` or :class:`MalformedMessage` (``not_msgpack``)."""
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise MalformedMessage(f"body is not msgpack: {e}", "not_msgpack") from None


def decode(cls: type[E], data: bytes) -> E:
    """Decode msgpack ``data`` into ``cls`` or raise :class:`MalformedMessage` saying why."""
    return cls.from_body(unpack(data))


def decode_or_log(cls: type[E], data: bytes, what: str, log: logging.Logger, context: str = "") -> E | None:
    """:func:`decode` a control message, or log that a malformed ``what`` is ignored (``context``
    prefixes the line) and return None: a bad control message never stops its receiver."""
    try:
        return decode(cls, data)
    except MalformedMessage as e:
        log.warning("%signoring malformed %s: %s", context, what, e)
        return None


class NdArray(BaseModel):
    """A numpy array as raw bytes plus dtype and shape."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, arr: np.ndarray) -> NdArray:
        a = np.ascontiguousarray(arr)
        return cls(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes())

    def to_numpy(self) -> np.ndarray:
        try:
            return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        except (TypeError, ValueError) as e:
            raise MalformedMessage(f"bad array payload: {e}", "bad_array") from None


class Sampling(BaseModel):
    """Sampling parameters of the thinker (OpenAI request fields, validated by the gateway)."""

    max_tokens: int = Field(ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False


class SpeechChunk(BaseModel):
    """One chunk of a speech request's input: its text and its tokens in the thinker's tokenizer
    (what a thinker's text chunk carries; a ``tiny`` talker speaks the tokens, others the text)."""

    text: str
    token_ids: list[int]


class Admission(_Envelope):
    """Gateway → orchestrator: a new request (subject ``requests``)."""

    request_id: Id
    gateway_id: Id
    arrival_ns: int
    deadline_ns: int
    prompt_token_ids: list[int] = Field(default_factory=list)
    sampling: Sampling | None = None
    """Stage 0's sampling (None for a request that does not run the thinker)."""
    audio: bool = False
    trace_id: str | None = None
    voice: str | None = None
    """The voice the talker speaks the request with, resolved by the gateway
    (:func:`libs.common.voices.resolve_voice`); None (or absent): the talker stage's default."""
    entry_stage: int = Field(default=0, ge=0)
    """The stage the request enters at: 0 (the thinker runs the prompt), or the talker's id for a
    speech request (``/v1/audio/speech``), whose input is ``text_chunks`` (the thinker is not run)."""
    text_chunks: list[SpeechChunk] = Field(default_factory=list)
    """A speech request's input text, cut by the gateway into chunks the talker speaks one by one,
    in order."""


class TextDelta(BaseModel):
    """One text delta of the thinker as the client received it."""

    token_ids: list[int]
    text: str


class TaskKind(StrEnum):
    START = "start"
    """Stage 0: run the whole prompt."""
    CHUNK = "chunk"
    """Later stages: one chunk of the upstream stage's output."""


class StageTask(_Envelope):
    """Orchestrator or upstream worker → worker (stage, replica) (subject ``stage.<s>.<r>.in``).

    ``route[s]`` is the replica bound to stage ``s`` for this request (sticky until the replica
    dies and the request moves). A chunk with ``final`` set is the last one of its request from
    the sender; it may carry no data.

    Attempts: a request's first run in a stage is attempt 1; each move to another replica of the
    stage (docs/reliability.md) starts the next. ``attempt`` is the receiving stage's attempt this
    task belongs to, ``from_attempt`` the sender's (1 for the orchestrator).
    """

    request_id: Id
    gateway_id: Id
    arrival_ns: int
    deadline_ns: int
    route: list[int]
    kind: TaskKind
    seq: int = Field(ge=0)
    final: bool = False
    prompt_token_ids: list[int] = Field(default_factory=list)
    sampling: Sampling | None = None
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    codes: NdArray | None = None
    attempt: int = Field(default=1, ge=1)
    from_attempt: int = Field(default=1, ge=1)
    resume: list[TextDelta] = Field(default_factory=list)
    """Stage 0 after a move: the text deltas the client already has, in order; the new attempt
    goes on after them (its input is the prompt plus their tokens)."""
    start_seq: int = Field(default=0, ge=0)
    """A later stage after a move: the first chunk the new attempt takes (those before it were
    handled by the attempt that died)."""
    offset: int = Field(default=0, ge=0)
    """A chunk: the position of its first item (token of a text chunk, code of a code chunk) in
    what its sender produced for the request; a talker that takes a request over starts its
    code numbering from the offset of its first text chunk."""
    context_before: int = Field(default=0, ge=0)
    context_after: int = Field(default=0, ge=0)
    """A code chunk: frames of context at the start and at the end of ``codes`` that are not the
    chunk's own audio (its neighbours' frames, which a non-causal codec needs to decode the own
    frames exactly as a whole-utterance decode would). The own frames are
    ``codes[context_before : len(codes) - context_after]``; the first of them is frame ``offset``
    of the request's code stream."""
    moved: bool = False
    """Set by the orchestrator on a stored input it sends again to the stage's new attempt after a
    move. The attempt before had taken that input, so the stage-0 fence (chunks of a thinker attempt
    the request moved past) does not drop it: for a chunk number it holds, no later copy may come."""
    next_attempt: int = Field(default=1, ge=1)
    next_start_seq: int = Field(default=0, ge=0)
    """A moved task: the next stage's current attempt and its ``start_seq`` (that stage may have
    moved before), which the new attempt's chunks go to."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class ClientEventType(StrEnum):
    STARTED = "started"
    """Stage 0 handed the request to its engine (once, before any output): the gateway starts a
    streamed response on it."""
    TEXT = "text"
    """A text delta of the thinker."""
    TEXT_DONE = "text_done"
    """The thinker finished: finish_reason and usage."""
    AUDIO = "audio"
    """A PCM16 chunk of the audio stage."""
    AUDIO_DONE = "audio_done"
    """The audio stage finished: total frames and sample rate."""
    ERROR = "error"
    """The request failed: status, code, message."""


class ClientEvent(_Envelope):
    """Worker/orchestrator → gateway (subject ``out.<gateway_id>.<request_id>``)."""

    request_id: Id
    type: ClientEventType
    stage: int | None = None
    replica: int | None = None
    seq: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    pcm16: bytes = b""
    sample_rate: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    status: int = 0
    code: str = ""
    message: str = ""
    attempt: int = 1
    """The sending stage's attempt; the gateway drops events of an attempt older than the one it
    was told of (the request moved on)."""
    in_seq: int | None = None
    """``audio``: the sequence number of the input chunk it was decoded from."""
    frames: int = 0
    """``audio``: the codec frames (a chunk's own, context excluded) its PCM was decoded from; a
    frame is one step of the codec (SNAC: 7 talker tokens; ``tiny``: one code)."""
    stage_gen_s: float | None = None
    """``audio_done``: the audio stage's generation time for the request, seconds: from its first
    input reaching the worker to its last audio sent, on that worker's monotonic clock (after a
    move, of the attempt that finished)."""

    @classmethod
    def from_body(cls, raw: object) -> ClientEvent:
        """A map of the fields, or a text delta's array (:data:`TEXT_LAYOUT`): one whose items
        are :func:`plain_text` becomes the event directly, any other is judged by the model as
        the map of the same fields (an array not starting with ``"text"`` is ``not_a_map``)."""
        if type(raw) is list and raw and raw[0] == TEXT_TAG:
            if plain_text(raw):
                return _text_event(raw)
            if len(raw) != len(TEXT_LAYOUT):
                raise MalformedMessage(f"a text delta array has {len(TEXT_LAYOUT)} items, got {len(raw)}")
            raw = dict(zip(TEXT_LAYOUT, raw, strict=True))
        return super().from_body(raw)


TEXT_TAG = "text"
"""The first item of a text delta's array: its ``type``."""
TEXT_LAYOUT = ("type", "request_id", "stage", "replica", "seq", "attempt", "text", "token_ids")
"""A text :class:`ClientEvent` on the bus: a msgpack array of these fields, in this order, the
others at their defaults. Map keys are strings the receiver builds on every decode; the array
holds the values only (60 bytes instead of the map's 218 for a one-token delta), and is packed
and checked without a pydantic model (:func:`pack_text`, :func:`plain_text`)."""
_TEXT_DEFAULTS = {
    name: f.get_default(call_default_factory=True) for name, f in ClientEvent.model_fields.items()
}
_TEXT_FIELDS = frozenset(TEXT_LAYOUT)
_set_attr = object.__setattr__
if ClientEvent.__pydantic_post_init__ or ClientEvent.__private_attributes__:
    raise TypeError("_text_event builds a ClientEvent as model_construct does, which would also run these")


def pack_text(
    request_id: str, stage: int, replica: int, seq: int, attempt: int, text: str, token_ids: list[int]
) -> bytes:
    """msgpack bytes of text delta ``seq`` of ``attempt`` of (``stage``, ``replica``): the event
    ``ClientEvent(type="text", ...).encode()`` sends as a map, as a :data:`TEXT_LAYOUT` array."""
    return msgpack.packb(
        [TEXT_TAG, request_id, stage, replica, seq, attempt, text, token_ids], use_bin_type=True
    )


def pack_batch(bodies: list[bytes]) -> bytes:
    """One message's body carrying several client events: a msgpack array of their bodies, each
    exactly as it would travel alone (binary items: nothing inside is packed again)."""
    return msgpack.packb(bodies, use_bin_type=True)


def unpack_batch(data: bytes) -> list[bytes]:
    """The event bodies of a :func:`pack_batch` body, in order, or :class:`MalformedMessage` when
    it is not a msgpack array of binary items (then none is taken)."""
    items = unpack(data)
    if type(items) is not list or not all(type(b) is bytes for b in items):
        raise MalformedMessage("a batch body must be an array of binary event bodies", "not_a_batch")
    return items


def plain_text(items: list) -> bool:
    """True when ``items`` is :data:`TEXT_LAYOUT` with each value of exactly the type
    :class:`ClientEvent` declares (``str``, ``int``, a list of ``int``) and an :data:`Id`: what
    the model would take unchanged. Anything else is the model's to judge (it may convert it)."""
    if len(items) != len(TEXT_LAYOUT):
        return False
    _, rid, stage, replica, seq, attempt, text, ids = items
    if type(rid) is not str or type(text) is not str or type(ids) is not list:
        return False
    if type(stage) is not int or type(replica) is not int or type(seq) is not int or type(attempt) is not int:
        return False
    if _ID.fullmatch(rid) is None:
        return False
    return all(type(t) is int for t in ids)


def _text_event(items: list) -> ClientEvent:
    """The ClientEvent of a :func:`plain_text` array, built as ``ClientEvent.model_construct``
    builds one (without its walk over every field's aliases, which costs more than validating)."""
    _, rid, stage, replica, seq, attempt, text, ids = items
    event = object.__new__(ClientEvent)
    fields = {
        **_TEXT_DEFAULTS,
        "request_id": rid,
        "type": ClientEventType.TEXT,
        "stage": stage,
        "replica": replica,
        "seq": seq,
        "text": text,
        "token_ids": ids,
        "attempt": attempt,
    }
    _set_attr(event, "__dict__", fields)
    _set_attr(event, "__pydantic_fields_set__", set(_TEXT_FIELDS))
    _set_attr(event, "__pydantic_extra__", None)
    _set_attr(event, "__pydantic_private__", None)
    return event


class EdgeSummary(BaseModel):
    """One request's transfers over one edge, as the receiver measured them (sums, seconds)."""

    from_stage: str
    from_replica: str
    to_stage: str
    to_replica: str
    hops: int = 0
    bytes: int = 0
    tx_s: float = 0.0
    rx_s: float = 0.0
    in_flight_s: float = 0.0


class LifecycleEvent(_Envelope):
    """All → orchestrator (subject ``events.<kind>``).

    A stage still working ``STARTED_REPORT_DELAY_S`` after taking a request's first input reports
    ``started`` (stamped with that moment); a stage that ends sooner carries the moment in
    ``started_ns`` of its ending event instead. The last stage folds ``stage_done`` into
    ``finished``.
    """

    request_id: Id
    kind: Literal["started", "stage_done", "finished", "failed", "aborted"]
    ts_ns: int
    stage: int | None = None
    replica: int | None = None
    finish_reason: str | None = None
    reason: str | None = None
    started_ns: int | None = None
    """When the stage took its first input (wall clock, ns), on an ending event whose stage sent
    no ``started``."""
    edges: list[EdgeSummary] = Field(default_factory=list)
    """Transfers this stage received for the request (``stage_done`` or the last stage's
    ``finished``, with --log-stats)."""
    attempt: int = 1
    """The reporting stage's attempt; the record ignores events of an attempt it has moved past."""
    client_events: int | None = None
    """An ending event (``stage_done``, ``finished``) of a stage that streams to the client: how
    many client events this attempt sent (``seq`` 0 to n − 1), the last one its ``text_done`` or
    ``audio_done``."""
    usage: Usage | None = None
    """The thinker's ``stage_done``: the usage its ``text_done`` reported."""


MOVED = "moved"
"""``AbortNotice.reason`` of a request that moved to another replica of ``stage``."""
ENGINE_DEAD = "engine_dead"
"""``AbortNotice``-style reason of a request stopped because its worker's engine died."""


class Liveness(_Envelope):
    """A worker's answer to its liveness probe (subject ``ctl.alive.<s>.<r>``); also the progress
    fields of its heartbeat. The answer itself says the worker's event loop runs; the fields say
    whether its engine does."""

    engine_dead: bool = False
    """The engine died under the live worker (it exits soon after)."""
    in_flight: int = 0
    """Requests this worker holds (running or waiting for their next input)."""
    busy: int = 0
    """Engine operations under way right now: generations waiting for their next engine output,
    chunks being decoded."""
    progress: int = 0
    """Outputs the engine has produced since the worker started (engine outputs of generations,
    decoded chunks): a counter that is flat while ``busy`` > 0 only when the engine is stuck."""


class AbortNotice(_Envelope):
    """Gateway/orchestrator → every worker (subject ``ctl.abort``): stop work on a request.

    With reason :data:`MOVED` only the attempts of ``stage`` older than ``attempt`` stop (the
    request runs on as ``attempt`` on another replica)."""

    request_id: Id
    reason: str = "abort"
    stage: int | None = None
    attempt: int = 0


class ResumeQuery(_Envelope):
    """Orchestrator → the request's gateway (subject ``ctl.resume.<gateway>``): where does the
    client's stream of ``stage`` stand? From now on the gateway drops events of that stage's
    attempts older than ``attempt``."""

    request_id: Id
    stage: int
    attempt: int
    replica: int | None = None
    """The replica the new attempt runs on: the gateway takes that attempt's events from it only
    (absent: from the replica its first event names)."""


class ResumePoint(_Envelope):
    """The gateway's answer to :class:`ResumeQuery`, taken after the fence was raised."""

    known: bool
    """False when the gateway no longer holds the request (its client is gone)."""
    deltas: list[TextDelta] = Field(default_factory=list)
    """Stage 0's text deltas the gateway has received, in order."""
    text_done: bool = False
    """Stage 0's ``text_done`` has arrived: nothing of the thinker is missing."""
    audio_seq: int | None = None
    """The asked stage's audio: the last input chunk whose audio the gateway has (None: none)."""
    audio_done: bool = False
    """The asked stage's ``audio_done`` has arrived."""


class StageEnded(_Envelope):
    """Orchestrator → the request's gateway (subject ``ctl.ended.<gateway>``): a stage that streams
    to the client ended its part of the request (its ending lifecycle event, durable in JetStream,
    has reached the orchestrator). Client events travel over core NATS and a broker restart may
    drop the last of them, which no later event would reveal as a gap; with this the gateway
    notices, and ends the client's stream instead of letting it wait for the deadline."""

    request_id: Id
    stage: int
    attempt: int
    replica: int = 0
    """The replica that ran the attempt (it keeps the events it sent, for a replay)."""
    client_events: int
    """How many client events the attempt sent."""
    finish_reason: str | None = None
    usage: Usage | None = None


class ReplayAsk(_Envelope):
    """Gateway → the worker that sent a request's client events (subject ``ctl.replay.<s>.<r>``):
    events ``from_seq`` to ``to_seq - 1`` of attempt ``attempt`` never arrived (a broker restart or
    a cluster node's death drops what it held); send them again."""

    request_id: Id
    attempt: int
    from_seq: int
    to_seq: int


class Replay(_Envelope):
    """The worker's answer to :class:`ReplayAsk`: the events it still holds, oldest first, as
    they were sent (encoded :class:`ClientEvent` s; a first part when they are many)."""

    known: bool
    """False when the worker no longer holds that attempt's events."""
    events: list[bytes] = Field(default_factory=list)


class Resync(_Envelope):
    """Gateway → one orchestrator (subject ``ctl.resync``, a queue group): events of the request's
    ``stage`` attempt ``attempt`` were lost on their way to the gateway (a broker restart drops what
    it held); the gateway has fenced that attempt off, and the request should go on as a new attempt
    from what the client has."""

    request_id: Id
    stage: int
    attempt: int


class RouteChange(_Envelope):
    """Orchestrator → the upstream worker of a stage that moved (subject ``ctl.route.<s>.<r>``).

    ``hold``: stop sending the request's chunks to ``stage`` (a chunk being sent finishes first)
    and answer with :class:`RouteHeld`. ``release``: send them on to ``replica`` as ``attempt``,
    the new attempt taking chunks from ``start_seq``."""

    request_id: Id
    stage: int
    action: Literal["hold", "release"]
    replica: int = 0
    attempt: int = 1
    start_seq: int = 0


class RouteHeld(_Envelope):
    """The upstream worker's answer to a ``hold``."""

    held: bool
    """False when this worker no longer works on the request (it has sent everything)."""
    next_seq: int = 0
    """The sequence number of the next chunk it will send to the stage."""
