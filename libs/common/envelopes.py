"""Message bodies on the bus: one ``msgspec.Struct`` per message kind, encoded with msgpack.

One encoder and one decoder per kind (:func:`decode`); decoding checks every field's type and bound,
so a malformed message raises :class:`MalformedMessage` (the receiver terminates it and counts the
reason). Arrays travel as raw bytes with dtype and shape (:class:`NdArray`). Unknown map keys are
ignored, so a receiver takes a sender's body that has a field more. A :class:`ClientEvent` (one per
streamed token) travels as an array of its fields' values in declared order; every other kind as a
map of the fields that differ from their defaults.
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
"""Longest request or gateway id a message may carry (the gateway's are 40-odd characters)."""
Id = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=MAX_ID_CHARS)]
"""A request or gateway id: one NATS subject token and KV key (``subjects.check_token``). Services
put these ids into subjects (``out.<gateway>.<request>``) and KV keys; one with a space, a dot or
a wildcard, or longer than the server's control line, would make the server close the publishing
connection (tests/e2e/test_fuzz_bus.py), so a message carrying one is malformed."""
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class _Envelope(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message kind: a map of its fields on the bus."""

    def encode(self) -> bytes:
        """msgpack bytes of this message."""
        return _ENCODER.encode(self)

    def replace(self, **changes: object) -> Self:
        """A copy with ``changes`` to its fields."""
        return msgspec.structs.replace(self, **changes)


_ENCODER = msgspec.msgpack.Encoder()
E = TypeVar("E", bound=_Envelope)


_WRONG_SHAPE = re.compile(r"Expected `(object|array)`, got `\w+`")
"""msgspec's complaint about a body that is not the kind's shape at all (a map, or for
:class:`ClientEvent` an array): reason ``not_a_map``."""


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
        name = getattr(cls, "__name__", str(cls))
        raise MalformedMessage(f"not a valid {name}: {text}", reason) from None
    except msgspec.DecodeError as e:
        raise MalformedMessage(f"body is not msgpack: {e}", "not_msgpack") from None


def decode_or_log(cls: type[E], data: bytes, what: str, log: logging.Logger, context: str = "") -> E | None:
    """:func:`decode` a control message, or log that a malformed ``what`` is ignored (``context``
    prefixes the line) and return None: a bad control message never stops its receiver."""
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
    """One chunk of a speech request's input: its text and its tokens in the thinker's tokenizer
    (what a thinker's text chunk carries; a ``tiny`` talker speaks the tokens, others the text)."""

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
    """The voice the talker speaks the request with, resolved by the gateway
    (:func:`libs.common.voices.resolve_voice`); None (or absent): the talker stage's default."""
    entry_stage: NonNegative = 0
    """The stage the request enters at: 0 (the thinker runs the prompt), or the talker's id for a
    speech request (``/v1/audio/speech``), whose input is ``text_chunks`` (the thinker is not run)."""
    text_chunks: list[SpeechChunk] = msgspec.field(default_factory=list)
    """A speech request's input text, cut by the gateway into chunks the talker speaks one by one,
    in order."""
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
    """The listener or the thinker after a move: the text deltas the client already has, in order; the new attempt
    goes on after them (its input is the prompt plus their tokens)."""
    start_seq: NonNegative = 0
    """A later stage after a move: the first chunk the new attempt takes (those before it were
    handled by the attempt that died)."""
    offset: NonNegative = 0
    """A chunk: the position of its first item (token of a text chunk, code of a code chunk) in
    what its sender produced for the request; a talker that takes a request over starts its
    code numbering from the offset of its first text chunk."""
    context_before: NonNegative = 0
    context_after: NonNegative = 0
    """A code chunk: frames of context at the start and at the end of ``codes`` that are not the
    chunk's own audio (its neighbours' frames, which a non-causal codec needs to decode the own
    frames exactly as a whole-utterance decode would). The own frames are
    ``codes[context_before : len(codes) - context_after]``; the first of them is frame ``offset``
    of the request's code stream."""
    moved: bool = False
    """Set by the orchestrator on a stored input it sends again to the stage's new attempt after a
    move. The attempt before had taken that input, so the thinker's fence (chunks of a thinker attempt
    the request moved past) does not drop it: for a chunk number it holds, no later copy may come."""
    next_attempt: Positive = 1
    next_start_seq: NonNegative = 0
    """A moved task: the next stage's current attempt and its ``start_seq`` (that stage may have
    moved before), which the new attempt's chunks go to."""
    transcription: Transcription | None = None
    """The listener's ``start`` task: the audio to transcribe."""


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class Heard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the listener heard. On its ``text`` event: where the segment's speech is in the input
    audio (seconds from its start) and Whisper's confidence figures of the segment; on its
    ``text_done``: the whole input (``end_s`` its duration) and the language."""

    start_s: float = 0.0
    end_s: float = 0.0
    language: str = ""
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class ClientEventType(StrEnum):
    STARTED = "started"
    """The entry stage (listener or thinker) handed the request to its engine (once, before any output): the gateway starts a
    streamed response on it."""
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
    """Worker/orchestrator → gateway (subject ``out.<gateway_id>.<request_id>``).

    On the bus an array of the fields' values in this order, no names: a one-token text delta is
    about 30 bytes (a map of the same fields took 218)."""

    type: ClientEventType
    request_id: Id
    stage: int | None = None
    replica: int | None = None
    seq: int = 0
    attempt: int = 1
    """The sending stage's attempt; the gateway drops events of an attempt older than the one it
    was told of (the request moved on)."""
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
    """``audio``: the codec frames (a chunk's own, context excluded) its PCM was decoded from; a
    frame is one step of the codec (SNAC: 7 talker tokens; ``tiny``: one code)."""
    stage_gen_s: float | None = None
    """``audio_done``: the audio stage's generation time for the request, seconds: from its first
    input reaching the worker to its last audio sent, on that worker's monotonic clock (after a
    move, of the attempt that finished)."""
    heard: Heard | None = None
    """The listener's ``text`` and ``text_done`` events: what it heard (:class:`Heard`)."""


_BATCH_DECODER = msgspec.msgpack.Decoder(list[bytes])


def pack_batch(bodies: list[bytes]) -> bytes:
    """One message's body carrying several client events: a msgpack array of their bodies, each
    exactly as it would travel alone (binary items: nothing inside is packed again)."""
    return _ENCODER.encode(bodies)


def unpack_batch(data: bytes) -> list[bytes]:
    """The event bodies of a :func:`pack_batch` body, in order, or :class:`MalformedMessage` when
    it is not a msgpack array of binary items (then none is taken)."""
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
    """One request's transfers over one edge, as the receiver measured them (sums, seconds); a
    dataclass, which both msgspec (the lifecycle event) and pydantic (the request record) take."""

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
    edges: list[EdgeSummary] = msgspec.field(default_factory=list)
    """Transfers this stage received for the request (``stage_done`` or the last stage's
    ``finished``, with --log-stats)."""
    attempt: int = 1
    """The reporting stage's attempt; the record ignores events of an attempt it has moved past."""


MOVED = "moved"
"""``AbortNotice.reason`` of a request that moved to another replica of ``stage``."""
ENGINE_DEAD = "engine_dead"
"""``AbortNotice``-style reason of a request stopped because its worker's engine died."""


class Liveness(_Envelope, kw_only=True):
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


class AbortNotice(_Envelope, kw_only=True, tag="abort"):
    """Stop work on a request. Gateway/orchestrator → every worker (subject ``ctl.abort``).

    With reason :data:`MOVED` only the attempts of ``stage`` older than ``attempt`` stop: the
    request runs on as ``attempt`` on another replica. Sent by a move as a request to the worker
    upstream of ``stage`` (subject ``ctl.route.<s - 1>.<r>``), a moved notice also ends the hold
    that the move's :class:`ResumeQuery` put on the request's chunks: they go on to ``replica`` as
    ``attempt``, whose first chunk is ``start_seq``; the answer is a :class:`ResumePoint`
    (``known`` false: this worker no longer works on the request)."""

    request_id: Id
    reason: str = "abort"
    stage: int | None = None
    attempt: int = 0
    replica: int | None = None
    """Where ``stage`` now runs (a moved notice sent to the upstream worker)."""
    start_seq: NonNegative = 0
    """The first chunk the new attempt takes (a moved notice sent to the upstream worker)."""


class ResumeQuery(_Envelope, kw_only=True, tag="resume"):
    """Where does the stream of ``stage`` attempt ``attempt`` stand? One question, asked of
    whoever sends that stage's stream:

    - of the request's gateway (the client's events) by an orchestrator moving the request
      (subject ``ctl.resume.<gateway>``: from then on the gateway drops events of that stage's
      attempts older than ``attempt``), and by the worker running the attempt (a request on the
      request's own ``out`` subject), which keeps its client events until the answer confirms
      them (services/stage_worker/client_stream.py);
    - of the worker upstream of ``stage`` (its chunks) by an orchestrator moving a later stage
      (subject ``ctl.route.<s - 1>.<r>``): that worker stops sending the request's chunks (a
      chunk being sent finishes first) until the move's :class:`AbortNotice` tells it where the
      stage now runs, and answers with the next chunk's ``seq``."""

    request_id: Id
    stage: int
    attempt: int
    replica: int | None = None
    """The replica running the attempt. A move's question binds the new attempt to it (the
    gateway takes that attempt's events from it only; absent: from the replica its first event
    names); a worker's must name the replica the attempt is bound to."""


RouteNotice = ResumeQuery | AbortNotice
"""What a move sends the worker upstream of the stage it moves (subject ``ctl.route.<s>.<r>``):
the question that holds the request's chunks, then the moved notice that releases them."""


class ResumePoint(_Envelope, kw_only=True):
    """Where a stream stands: the answer to :class:`ResumeQuery`. The gateway's to a move is taken
    after the fence was raised; a worker's, and an upstream worker's (of the request's chunks for
    the stage), carry ``known`` and ``next_seq`` only."""

    known: bool
    """False when the gateway no longer takes events of the attempt: it no longer holds the
    request (its client is gone), or the request has moved past the attempt."""
    next_seq: NonNegative = 0
    """The ``seq`` of the next event of the asked attempt the client's stream takes: every
    event before it has arrived."""
    deltas: list[TextDelta] = msgspec.field(default_factory=list)
    """The text deltas (of the thinker or the listener) the gateway has received, in order."""
    text_done: bool = False
    """The ``text_done`` of the thinker or the listener has arrived: no text is missing."""
    audio_seq: int | None = None
    """The asked stage's audio: the last input chunk whose audio the gateway has (None: none)."""
    audio_done: bool = False
    """The asked stage's ``audio_done`` has arrived."""
