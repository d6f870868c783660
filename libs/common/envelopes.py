"""Message bodies on the bus: one ``msgspec.Struct`` per message kind, encoded with msgpack.

Decoding checks every field's type and bound (:func:`decode` raises :class:`MalformedMessage`);
unknown map keys are ignored. A :class:`ClientEvent` travels as an array of its fields' values in
declared order; every other kind as a map of the fields that differ from their defaults.
Times are wall-clock ns (``time.time_ns()``) unless a field says otherwise.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Annotated, Literal, Self, TypeVar

import msgspec
import numpy as np


class MalformedMessage(ValueError):
    """A bus message that cannot be used; ``reason`` is a short code for metrics."""

    def __init__(self, message: str, reason: str = "invalid_envelope") -> None:
        super().__init__(message)
        self.reason = reason


MAX_ID_CHARS = 128
"""Longest request or gateway id a message may carry."""
Id = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=MAX_ID_CHARS)]
"""A request or gateway id: one NATS subject token and KV key."""
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class _Envelope(msgspec.Struct, kw_only=True, omit_defaults=True):
    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    def replace(self, **changes: object) -> Self:
        return msgspec.structs.replace(self, **changes)


_ENCODER = msgspec.msgpack.Encoder()
E = TypeVar("E", bound=_Envelope)


_WRONG_SHAPE = re.compile(r"Expected `(object|array)`, got `\w+`")


@cache
def _decoder(cls: type[E]) -> msgspec.msgpack.Decoder[E]:
    return msgspec.msgpack.Decoder(cls)


def decode(cls: type[E], data: bytes) -> E:
    """Decode msgpack ``data`` into ``cls`` or raise :class:`MalformedMessage` saying why:
    ``not_msgpack``, ``not_a_map`` (a body of another shape than the kind's), ``invalid_envelope``
    (a field missing, of the wrong type or out of bounds)."""
    try:
        return _decoder(cls).decode(data)
    except msgspec.ValidationError as e:
        text = str(e)
        reason = "not_a_map" if _WRONG_SHAPE.fullmatch(text) else "invalid_envelope"
        raise MalformedMessage(f"not a valid {getattr(cls, '__name__', cls)}: {text}", reason) from None
    except msgspec.DecodeError as e:
        raise MalformedMessage(f"body is not msgpack: {e}", "not_msgpack") from None


def decode_or_log(cls: type[E], data: bytes, what: str, log: logging.Logger, context: str = "") -> E | None:
    """:func:`decode`, or log that a malformed ``what`` is ignored and return None."""
    try:
        return decode(cls, data)
    except MalformedMessage as e:
        log.warning("%signoring malformed %s: %s", context, what, e)
        return None


class NdArray(msgspec.Struct, kw_only=True):
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


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters of the thinker (OpenAI request fields, validated by the gateway)."""

    max_tokens: Positive
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False


class SpeechChunk(msgspec.Struct, kw_only=True):
    """One chunk of a speech request's input: its text and its tokens in the thinker's tokenizer."""

    text: str
    token_ids: list[int]


INPUT_SAMPLE_RATE = 16_000
"""Sample rate of the caller's audio on the bus, Hz (mono PCM16, little-endian): Whisper's."""


class Transcription(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A listener's input: the caller's audio and OpenAI's transcription options."""

    pcm16: bytes
    """Mono PCM16 at :data:`INPUT_SAMPLE_RATE`, little-endian."""
    language: str | None = None
    """ISO 639-1 code of the spoken language; None: the listener's default."""
    prompt: str = ""
    """Text that precedes the audio (names, spelling, style)."""
    temperature: float = 0.0


class Admission(_Envelope, kw_only=True):
    """Gateway → orchestrator: a new request (subject ``requests``)."""

    request_id: Id
    gateway_id: Id
    arrival_ns: int
    deadline_ns: int
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    sampling: Sampling | None = None
    """The thinker's sampling (None for a request that does not run the thinker)."""
    audio: bool = False
    trace_id: str | None = None
    voice: str | None = None
    """The talker's voice (:func:`libs.common.voices.resolve_voice`); None: the stage's default."""
    entry_stage: NonNegative = 0
    """The stage the request enters at (the talker for a speech request: ``text_chunks``)."""
    text_chunks: list[SpeechChunk] = msgspec.field(default_factory=list)
    """A speech request's input text in the chunks the talker speaks, in order."""
    transcription: Transcription | None = None
    """A transcription request's input, for the listener it enters at."""


class TextDelta(msgspec.Struct, kw_only=True):
    """One text delta of the thinker as the client received it."""

    token_ids: list[int]
    text: str


class TaskKind(StrEnum):
    START = "start"
    """The listener or the thinker: run the whole input (audio, prompt)."""
    CHUNK = "chunk"
    """Later stages: one chunk of the upstream stage's output."""


class StageTask(_Envelope, kw_only=True):
    """Orchestrator or upstream worker → worker (stage, replica) (subject ``stage.<s>.<r>.in``).

    ``route[s]`` is the replica bound to stage ``s``. A chunk with ``final`` set is the sender's
    last for the request (it may carry no data). ``attempt`` is the receiving stage's attempt (1,
    then one more per move to another replica), ``from_attempt`` the sender's (1 for the
    orchestrator).
    """

    request_id: Id
    gateway_id: Id
    arrival_ns: int
    deadline_ns: int
    route: list[int]
    kind: TaskKind
    seq: NonNegative
    final: bool = False
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    sampling: Sampling | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    text: str = ""
    codes: NdArray | None = None
    attempt: Positive = 1
    from_attempt: Positive = 1
    resume: list[TextDelta] = msgspec.field(default_factory=list)
    """The entry stage after a move: the text deltas the client already has, in order."""
    start_seq: NonNegative = 0
    """A later stage after a move: the first chunk the new attempt takes."""
    offset: NonNegative = 0
    """A chunk: the position of its first token or code in what its sender produced."""
    context_before: NonNegative = 0
    context_after: NonNegative = 0
    """A code chunk: frames of its neighbours' context at the start and end of ``codes``; its own
    frames are ``codes[context_before : len(codes) - context_after]``, the first being frame
    ``offset`` of the request's code stream."""
    moved: bool = False
    """A stored input the orchestrator sends again to the stage's new attempt after a move."""
    next_attempt: Positive = 1
    next_start_seq: NonNegative = 0
    """A moved task: where the new attempt's chunks go (the next stage's attempt and start_seq)."""
    transcription: Transcription | None = None
    """The listener's ``start`` task: the audio to transcribe."""


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class Heard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the listener heard: on ``text``, the segment's place in the input audio (seconds from
    its start) and Whisper's confidence figures; on ``text_done``, the whole input and language."""

    start_s: float = 0.0
    end_s: float = 0.0
    language: str = ""
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class ClientEventType(StrEnum):
    STARTED = "started"
    """The entry stage handed the request to its engine (once, before any output)."""
    TEXT = "text"
    """A text delta of the thinker, or a segment of the listener's transcript."""
    TEXT_DONE = "text_done"
    """The thinker or the listener finished: finish_reason and usage."""
    AUDIO = "audio"
    """A PCM16 chunk of the audio stage."""
    AUDIO_DONE = "audio_done"
    """The audio stage finished: total frames and sample rate."""
    ERROR = "error"
    """The request failed: status, code, message."""


class ClientEvent(_Envelope, kw_only=True, array_like=True):
    """Worker/orchestrator → gateway (subject ``out.<gateway_id>.<request_id>``), an array on the bus."""

    type: ClientEventType
    request_id: Id
    stage: int | None = None
    replica: int | None = None
    seq: int = 0
    attempt: int = 1
    """The sending stage's attempt."""
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    pcm16: bytes = b""
    sample_rate: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    status: int = 0
    code: str = ""
    message: str = ""
    in_seq: int | None = None
    """``audio``: the sequence number of the input chunk it was decoded from."""
    frames: int = 0
    """``audio``: the codec frames (the chunk's own) its PCM was decoded from."""
    stage_gen_s: float | None = None
    """``audio_done``: first input to last audio sent, seconds on the worker's monotonic clock."""
    heard: Heard | None = None
    """The listener's ``text`` and ``text_done`` events."""


_BATCH_DECODER = msgspec.msgpack.Decoder(list[bytes])


def pack_batch(bodies: list[bytes]) -> bytes:
    """One body carrying several client events: a msgpack array of their bodies as sent alone."""
    return _ENCODER.encode(bodies)


def unpack_batch(data: bytes) -> list[bytes]:
    """The event bodies of a :func:`pack_batch` body, in order, or :class:`MalformedMessage`."""
    try:
        return _BATCH_DECODER.decode(data)
    except msgspec.ValidationError:
        raise MalformedMessage(
            "a batch body must be an array of binary event bodies", "not_a_batch"
        ) from None
    except msgspec.DecodeError as e:
        raise MalformedMessage(f"body is not msgpack: {e}", "not_msgpack") from None


@dataclass
class EdgeSummary:
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


class LifecycleEvent(_Envelope, kw_only=True):
    """All → orchestrator (subject ``events.<kind>``); the last stage sends no ``stage_done``."""

    request_id: Id
    kind: Literal["started", "stage_done", "finished", "failed", "aborted"]
    ts_ns: int
    stage: int | None = None
    replica: int | None = None
    finish_reason: str | None = None
    reason: str | None = None
    started_ns: int | None = None
    """When the stage took its first input, on an ending event whose stage sent no ``started``."""
    edges: list[EdgeSummary] = msgspec.field(default_factory=list)
    """Transfers this stage received for the request (with --log-stats)."""
    attempt: int = 1
    """The reporting stage's attempt."""


MOVED = "moved"
"""``AbortNotice.reason`` of a request that moved to another replica of ``stage``."""
ENGINE_DEAD = "engine_dead"
"""``AbortNotice``-style reason of a request stopped because its worker's engine died."""


class Liveness(_Envelope, kw_only=True):
    """A worker's answer to its liveness probe (subject ``ctl.alive.<s>.<r>``)."""

    engine_dead: bool = False
    """The engine died under the live worker (it exits soon after)."""
    in_flight: int = 0
    """Requests this worker holds (running or waiting for their next input)."""
    busy: int = 0
    """Engine operations under way right now (generations, chunks being decoded)."""
    progress: int = 0
    """Outputs the engine has produced since the worker started (flat while busy: stuck)."""


class AbortNotice(_Envelope, kw_only=True, tag="abort"):
    """Stop work on a request. Gateway/orchestrator → every worker (subject ``ctl.abort``).

    With reason :data:`MOVED` only the attempts of ``stage`` older than ``attempt`` stop. Sent as
    a request to the worker upstream of ``stage`` (``ctl.route.<s - 1>.<r>``), a moved notice
    also releases the request's chunks held by the move's :class:`ResumeQuery`: they go on to
    ``replica`` as ``attempt`` from ``start_seq``; the answer is a :class:`ResumePoint`."""

    request_id: Id
    reason: str = "abort"
    stage: int | None = None
    attempt: int = 0
    replica: int | None = None
    start_seq: NonNegative = 0


class ResumeQuery(_Envelope, kw_only=True, tag="resume"):
    """Where does the stream of ``stage`` attempt ``attempt`` stand? Asked of:

    - the request's gateway, by an orchestrator moving the request (``ctl.resume.<gateway>``;
      the gateway then drops events of older attempts of the stage), and by the worker running
      the attempt (a request on the request's ``out`` subject);
    - the worker upstream of ``stage``, by an orchestrator moving a later stage
      (``ctl.route.<s - 1>.<r>``): it holds the request's chunks until the move's
      :class:`AbortNotice` and answers with the next chunk's ``seq``."""

    request_id: Id
    stage: int
    attempt: int
    replica: int | None = None
    """The replica running the attempt (a move's question binds the new attempt to it)."""


RouteNotice = ResumeQuery | AbortNotice
"""What a move sends the worker upstream of the stage it moves (subject ``ctl.route.<s>.<r>``)."""


class ResumePoint(_Envelope, kw_only=True):
    """Where a stream stands: the answer to :class:`ResumeQuery`."""

    known: bool
    """False when the asked attempt's stream is no longer taken (client gone, request moved on)."""
    next_seq: NonNegative = 0
    """The ``seq`` of the next event of the asked attempt: every one before it has arrived."""
    deltas: list[TextDelta] = msgspec.field(default_factory=list)
    """The text deltas (of the thinker or the listener) the gateway has received, in order."""
    text_done: bool = False
    """The ``text_done`` of the thinker or the listener has arrived: no text is missing."""
    audio_seq: int | None = None
    """The asked stage's audio: the last input chunk whose audio the gateway has (None: none)."""
    audio_done: bool = False
    """The asked stage's ``audio_done`` has arrived."""
