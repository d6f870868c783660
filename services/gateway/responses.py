"""Turning a request's bus events into OpenAI responses: one JSON body, or Server-Sent Events."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from fastapi import Request
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from libs.common.envelopes import ClientEvent, ClientEventType
from libs.common.playback import AudioChunk
from services.gateway.audio import encode_whole
from services.gateway.errors import APIError, ClientGone
from services.gateway.event_trust import FORWARDED_STATUSES
from services.gateway.pipeline_client import PipelineClient, RequestHandle, timed_out
from services.gateway.request_stats import GatewayStatLogger, RequestStats
from services.gateway.schemas import AudioOut, Usage

DEFAULT_SAMPLE_RATE = 24_000
"""The sample rate of an empty audio answer (no chunk said its own), Hz."""
AUDIO_EXPIRY_S = 3600
"""``audio.expires_at`` is this far in the future (informational: nothing is stored)."""
DISCONNECT_POLL_S = 0.25
BACKLOG_GRACE_S = 1.0
"""How long a streamed response's backlog must stay over its ``max_buffered`` events before its
client counts as too slow, seconds: a burst is no slowness. After the gateway's own pause (a stop,
a long collection) the bus's backlog lands in the handles at once (1,182 events for one stream in
a test that stopped the gateway), and a client that reads takes it in milliseconds."""
BACKLOG_HARD_FACTOR = 8
"""... but a backlog over this many times ``max_buffered`` is too slow at once (the memory bound:
a writer blocked on a client that reads nothing checks nothing until its write times out)."""
MAX_CHUNKS_PER_WRITE = 32
"""At most this many SSE events are joined into one write of a streamed response."""
T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class Job:
    """A submitted request as the response code sees it."""

    handle: RequestHandle
    client: PipelineClient
    model: str
    created: int
    stats: RequestStats
    log: GatewayStatLogger
    span: Span = INVALID_SPAN
    """The HTTP request's SERVER span (the root of the request's trace)."""
    audio_format: str | None = None
    """Requested audio format, None for a text-only request."""
    return_token_ids: bool = False
    speech: bool = False
    """A speech request (``/v1/audio/speech``): no text, done at the audio stage's end."""
    speech_tokens: int = 0
    """A speech request: its input's tokens (the thinker's tokenizer)."""
    speech_frames: int = 0
    """A speech request: the codec frames of its audio, once it has all come."""
    max_buffered: int = 0
    """Events that may wait for a streamed response's client before it is a slow reader (0: any)."""
    abandoned: bool = False
    """Aborted because its client went away or read too slowly (:func:`abandon`, once)."""

    @property
    def id(self) -> str:
        return self.handle.request_id

    @property
    def audio_id(self) -> str:
        return f"audio-{self.id}"


@dataclass
class Collected:
    """Everything a non-streaming response needs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pcm: bytearray = field(default_factory=bytearray)
    sample_rate: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, ev: ClientEvent) -> None:
        if ev.type == ClientEventType.TEXT:
            self.text.append(ev.text)
            self.token_ids.extend(ev.token_ids)
        elif ev.type == ClientEventType.AUDIO:
            self.pcm += ev.pcm16
            self.sample_rate = ev.sample_rate
        elif ev.type == ClientEventType.TEXT_DONE:
            self.finish_reason = ev.finish_reason
            self.usage = usage_of(ev)
        elif ev.type == ClientEventType.AUDIO_DONE:
            self.sample_rate = ev.sample_rate or self.sample_rate


def usage_of(ev: ClientEvent) -> Usage | None:
    if ev.usage is None:
        return None
    p, c = ev.usage.prompt_tokens, ev.usage.completion_tokens
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


async def events_until_done(job: Job) -> AsyncIterator[ClientEvent]:
    """A request's events up to completion: the thinker's ``text_done`` (none for a speech
    request) and, for audio requests, the audio stage's ``audio_done``. An ``error`` event raises
    :class:`APIError`; for a streamed response, more than ``job.max_buffered`` events waiting for
    :data:`BACKLOG_GRACE_S`, or :data:`BACKLOG_HARD_FACTOR` times that at once (its client reads
    slower than the pipeline writes), raise :class:`SlowReader`."""
    text_done = audio_done = False
    over_since: float | None = None  # when the backlog went over max_buffered (time.monotonic())
    try:
        async for ev in job.handle.events():
            now = time.monotonic()
            if (
                job.stats.streamed
                and job.max_buffered
                and (waiting := job.handle.queue.qsize()) > job.max_buffered
            ):
                over_since = now if over_since is None else over_since
                if now - over_since >= BACKLOG_GRACE_S or waiting > BACKLOG_HARD_FACTOR * job.max_buffered:
                    raise SlowReader(f"{waiting} events waiting for the client")
            else:
                over_since = None
            job.log.started(job.stats, now)
            if ev.type in (ClientEventType.ERROR, ClientEventType.AUDIO_DONE) and ev.stage:
                job.stats.audio_stage_ended(ev.stage, ev.replica)
            if ev.type == ClientEventType.ERROR:
                raise error_of(ev)
            if ev.type == ClientEventType.AUDIO:
                job.stats.audio_received(ev.stage, ev.replica, len(ev.pcm16), ev.sample_rate, now)
            elif ev.type == ClientEventType.AUDIO_DONE:
                job.stats.stage_gen_s = ev.stage_gen_s
            elif ev.type == ClientEventType.TEXT_DONE:
                job.stats.finished_reason = ev.finish_reason
                if ev.usage is not None:
                    job.stats.input_tokens, job.stats.output_tokens = (
                        ev.usage.prompt_tokens,
                        ev.usage.completion_tokens,
                    )
            yield ev
            text_done = text_done or ev.type == ClientEventType.TEXT_DONE
            audio_done = audio_done or ev.type == ClientEventType.AUDIO_DONE
            if (text_done or job.speech) and (audio_done or job.audio_format is None):
                return
    except APIError as e:
        job.stats.failure = e.code or "pipeline_error"
        raise


CONTROL_PLANE_CODES = frozenset(
    {
        "timeout",
        "no_live_replica",
        "replica_lost",
        "migration_limit",
        "queue_full",
        "bus_unavailable",
    }
)
"""Error codes whose message omnirelay's orchestrator or gateway writes itself (no exception
text, no internals): the client reads it as it is."""


class SlowReader(Exception):
    """The client reads a streamed response too slowly: it is aborted (every stage stops the
    request) and its connection closed (:class:`services.gateway.app.ResponseTimer`)."""


def error_of(ev: ClientEvent) -> APIError:
    """The client-facing error of an ``error`` event: its status (one of
    :data:`FORWARDED_STATUSES`) and code; its message only for :data:`CONTROL_PLANE_CODES`. A
    stage's message (an engine's or codec's exception text) goes to the gateway's log with the
    request id, and the client gets a generic one naming the code and the request id."""
    status = ev.status if ev.status in FORWARDED_STATUSES else 500  # the bus client made it 502 before
    code = ev.code or "pipeline_error"
    if code in CONTROL_PLANE_CODES:
        return APIError(status, ev.message or "the pipeline failed", code)
    log.warning(
        "request %s failed in stage %s: %s %s: %s", ev.request_id, ev.stage, ev.status, code, ev.message
    )
    return APIError(status, f"the request failed in the pipeline ({code}); request id {ev.request_id}", code)


def abort_reason(e: BaseException | None) -> str:
    """Why a failed request is aborted in every stage: ``timeout`` or ``failed``."""
    return "timeout" if isinstance(e, APIError) and e.code == "timeout" else "failed"


async def collect(job: Job) -> Collected:
    out = Collected()
    async for ev in events_until_done(job):
        out.add(ev)
    return out


def audio_message(job: Job, c: Collected) -> AudioOut:
    """OpenAI's ``message.audio``: base64 of the whole file in ``audio.format`` (raw PCM16 for
    ``pcm16``) plus the transcript."""
    raw = encode_whole(job.audio_format or "wav", bytes(c.pcm), c.sample_rate or DEFAULT_SAMPLE_RATE)
    return AudioOut(
        id=job.audio_id,
        data=base64.b64encode(raw).decode(),
        expires_at=int(time.time()) + AUDIO_EXPIRY_S,
        transcript="".join(c.text),
    )


async def guarded(request: Request, job: Job, work: Awaitable[T]) -> T:
    """Run ``work`` for a non-streaming response; abort the request everywhere if the client goes
    away or the work fails, release it when done."""
    task = asyncio.ensure_future(work)
    finished = left = False
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                abandon(job)
                left = True  # aborted once, as "client disconnected" (the task is not done yet)
                raise ClientGone
        result = task.result()
        finished = True
        return result
    finally:
        if not task.done():
            task.cancel()
        if finished:
            job.client.release(job.id)
        elif not left and not task.cancelled():
            job.client.abort(job.id, _abort_reason(task))


async def until_started(request: Request, job: Job) -> None:
    """Wait for a streamed request's first event before its response begins: stage 0's
    ``started`` (its engine has the request) or an error. An error — no live replica, expired in
    the queue, a failing stage — or the gateway's timeout is raised as :class:`APIError` here,
    so the client gets its HTTP status instead of a 200 stream that only carries an error. A
    client that hangs up meanwhile aborts the request."""
    handle = job.handle
    while handle.first is None:
        if handle.seconds_left <= 0:
            _failed(job, timed_out())
        try:
            async with asyncio.timeout(min(DISCONNECT_POLL_S, max(handle.seconds_left, 0.0))):
                await handle.arrived.wait()
        except TimeoutError:
            if await request.is_disconnected():
                abandon(job)
                raise ClientGone from None
    ev = handle.first
    if ev.type == ClientEventType.ERROR:
        _failed(job, error_of(ev))


def _failed(job: Job, e: APIError) -> NoReturn:
    """End a request that failed before its response began (stopped in every stage)."""
    job.stats.failure = e.code or "pipeline_error"
    job.client.abort(job.id, abort_reason(e))
    raise e


def _abort_reason(task: asyncio.Future) -> str:
    e = None
    with contextlib.suppress(BaseException):
        e = task.exception()
    return abort_reason(e)


def sse(obj: object) -> str:
    return f"data: {obj}\n\n"


async def sse_stream(
    job: Job,
    head: list[str],
    render: Callable[[ClientEvent], list[str]],
    tail: Callable[[Collected], list[str]],
) -> AsyncIterator[str]:
    """Server-Sent Events of one request (begun after :func:`until_started`): the ``head``
    chunks, then ``render`` of each event (zero or more JSON chunks), then ``tail``; ends with
    ``[DONE]``. The head goes out with the first event — stage 0's ``started``, so the client
    reads it while the engine computes the first token (vLLM's server sends its role chunk with
    the first output) — and events that are already waiting are written together. A client that disconnects (the generator is
    closed early) or a failure aborts the request in every stage."""
    state = Collected()
    completed = False
    held = [sse(chunk) for chunk in head]
    try:
        try:
            async for ev in events_until_done(job):
                state.add(ev)
                if ev.type == ClientEventType.AUDIO:
                    job.stats.audio_chunks.append(AudioChunk(time.monotonic(), len(ev.pcm16)))
                held += [sse(chunk) for chunk in render(ev)]
                # Events already waiting go out in the same write (fewer sends when busy).
                if held and (job.handle.queue.empty() or len(held) >= MAX_CHUNKS_PER_WRITE):
                    yield "".join(held)
                    held = []
            held += [sse(chunk) for chunk in tail(state)]
            if held:
                yield "".join(held)
            completed = True
        except APIError as e:
            yield "".join([*held, e.sse()])
            job.client.abort(job.id, abort_reason(e))
            completed = True
        yield sse("[DONE]")
    finally:
        if completed:
            job.client.release(job.id)
        else:
            abandon(job)


def body_started(job: Job, now: float) -> None:
    """The response body began to be written: for a non-streamed audio response, that is when
    the client got its audio (one chunk: the whole of it)."""
    s = job.stats
    if s.audio and not s.streamed and s.audio_bytes:
        s.audio_chunks.append(AudioChunk(now, s.audio_bytes))


def abandon(job: Job) -> None:
    """The client went away: abort the request everywhere and record it as aborted (once)."""
    if job.abandoned:
        return
    job.abandoned = True
    job.client.abort(job.id, "client disconnected")
    job.stats.finished_reason = "abort"
    finish(job, time.monotonic())


def finish(job: Job, end_s: float) -> None:
    """The response is over (last byte written, or the client left): record it once."""
    if job.stats.done:
        return
    job.log.ended(job.stats, end_s)
    s, span = job.stats, job.span
    if span.is_recording():
        span.set_attributes(
            {
                "gen_ai.response.id": job.id,
                "gen_ai.usage.input_tokens": s.input_tokens,
                "gen_ai.usage.output_tokens": s.output_tokens,
                "gen_ai.response.finish_reasons": [s.finished_reason or ""],
                "omnirelay.audio.bytes": s.audio_bytes,
            }
        )
        if s.failure:
            span.set_status(Status(StatusCode.ERROR, s.failure))
    span.end()
