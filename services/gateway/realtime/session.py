"""One realtime session: its configuration, its conversation, its input audio buffer and the
response under way, changed only by the client's events and the pipeline's (one task at a time:
the socket's reader calls :meth:`RealtimeSession.handle`; responses and transcriptions run as tasks
that send their own events).

A spoken turn: the VAD marks its start (``input_audio_buffer.speech_started``; a response under way
is cancelled when ``interrupt_response``: barge-in) and its end (``speech_stopped``); the turn is
committed as a user item, heard by the listener (its transcript in
``conversation.item.input_audio_transcription.completed``), and, when ``create_response``, answered.
A response's prompt is the conversation as text: the session's instructions, then every item's
text or transcript, templated by the thinker's chat template at the gateway.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, set_span_in_context

from libs.common.envelopes import Transcription
from libs.common.pipeline import PipelineConfig
from libs.common.tracing import start_span
from services.gateway.errors import APIError
from services.gateway.realtime import responses
from services.gateway.realtime.input_audio import InputBuffer, Turn
from services.gateway.realtime.protocol import (
    AudioAppend,
    AudioClear,
    AudioCommit,
    BadEvent,
    ClientEvent,
    Content,
    Item,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    ResponseCancel,
    ResponseCreate,
    Session,
    SessionUpdate,
    error_event,
    server_event,
)
from services.gateway.realtime.responses import Response, ResponsePlan
from services.gateway.submission import Arrival, Submitter
from services.gateway.transcription import Transcript, transcript_once
from services.gateway.voice_activity import SpeechPaused, SpeechStarted, SpeechStopped

log = logging.getLogger(__name__)

MAX_ITEMS = 256
"""Conversation items one session keeps; past it, the oldest go (OpenAI truncates too)."""
Send = Callable[[dict[str, Any]], Awaitable[None]]


class SessionMetrics(Protocol):
    """What a session tells the gateway's metrics (the gateway's stat logger)."""

    def voice_to_voice(self, seconds: float) -> None: ...

    def interrupted(self, cause: str) -> None: ...


class RealtimeSession:
    def __init__(self, send: Send, submitter: Submitter, model: str, metrics: SessionMetrics) -> None:
        self.send, self.submitter, self.metrics = send, submitter, metrics
        self.config = Session(model=model)
        self.items: dict[str, Item] = {}
        self.buffer = InputBuffer(self.config.audio.input.format.type, self.config.audio.input.turn_detection)
        self.response: Response | None = None
        self._turn_item: str | None = None
        """The id the user item of the turn being spoken will get."""
        self._guess: _Guess | None = None
        """The transcription begun at the spoken turn's last pause (:meth:`_guess_turn`)."""
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pipeline(self) -> PipelineConfig:
        return self.submitter.pipeline

    async def start(self) -> None:
        await self.send(server_event("session.created", session=self.config.shown()))

    async def close(self) -> None:
        """The socket closed: stop the response under way and every transcription."""
        self._drop_guess()
        if self.response is not None:
            responses.stop(self.response, "client disconnected")
        for task in list(self._tasks):
            task.cancel()

    async def handle(self, event: ClientEvent) -> None:
        """Apply one client event; a :class:`BadEvent` is the client's ``error``."""
        handler = _HANDLERS[type(event)]
        await handler(self, event)

    # --- session and input audio ---------------------------------------------------------------
    async def _update(self, e: SessionUpdate) -> None:
        try:
            config = self.config.updated(e.session)
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise BadEvent(f"session: {err}", "invalid_value", "session") from None
        if "audio" in config.output_modalities:
            self._check_voice(config.audio.output.voice)
        inp, old = config.audio.input, self.config.audio.input
        if (inp.format, inp.turn_detection) != (old.format, old.turn_detection):
            self.buffer = InputBuffer(inp.format.type, inp.turn_detection)
        self.config = config
        await self.send(server_event("session.updated", session=config.shown()))

    def _check_voice(self, voice: str) -> None:
        from libs.common.voices import UnknownVoice, resolve_voice, talker_config

        try:
            resolve_voice(talker_config(self.pipeline), voice, "audio.output.voice")
        except UnknownVoice as err:
            raise BadEvent(str(err), "invalid_value", "session.audio.output.voice") from None

    async def _append(self, e: AudioAppend) -> None:
        try:
            data = base64.b64decode(e.audio, validate=True)
        except binascii.Error:
            raise BadEvent("audio is not base64", "invalid_value", "audio") from None
        for mark in self.buffer.append(data):
            if isinstance(mark, SpeechStarted):
                await self._speech_started(mark)
            elif isinstance(mark, SpeechPaused):
                self._guess_turn(mark)
            elif isinstance(mark, SpeechStopped):
                await self._speech_stopped(mark)

    def _guess_turn(self, mark: SpeechPaused) -> None:
        """Begin transcribing the turn as if it ended at this pause: when the silence lasts, the
        turn ends there and its transcript is (nearly) ready; when speech goes on, it is dropped."""
        self._drop_guess()
        span = self._turn_span(self._turn_item or "")
        self._guess = _Guess(
            mark.audio_end_ms, span, self._listening(self.buffer.peek(mark.audio_end_ms), span)
        )

    def _drop_guess(self) -> None:
        if self._guess is not None:
            self._guess.heard.cancel()  # its request is aborted in the listener (transcript_once)
            self._guess.span.end()
            self._guess = None

    async def _speech_started(self, mark: SpeechStarted) -> None:
        self._turn_item = Item(role="user").id
        await self.send(
            server_event(
                "input_audio_buffer.speech_started",
                audio_start_ms=mark.audio_start_ms,
                item_id=self._turn_item,
            )
        )
        vad = self.config.audio.input.turn_detection
        if vad is not None and vad.interrupt_response and self.response is not None:
            await self._cancel(self.response, "turn_detected")

    async def _speech_stopped(self, mark: SpeechStopped) -> None:
        item_id = self._turn_item or Item(role="user").id
        await self.send(
            server_event("input_audio_buffer.speech_stopped", audio_end_ms=mark.audio_end_ms, item_id=item_id)
        )
        vad = self.config.audio.input.turn_detection
        turn, guess = self.buffer.commit(mark.audio_end_ms), self._guess
        if guess is not None and guess.end_ms == mark.audio_end_ms:  # the pause was the turn's end
            self._guess = None
            await self._commit(turn, item_id, vad is not None and vad.create_response, guess)
            return
        self._drop_guess()
        await self._commit(turn, item_id, respond=vad is not None and vad.create_response)

    async def _commit_now(self, e: AudioCommit) -> None:
        if self.buffer.empty:
            raise BadEvent("the input audio buffer is empty", "input_audio_buffer_commit_empty")
        await self._commit(self.buffer.commit(), Item(role="user").id, respond=False)

    async def _clear(self, e: AudioClear) -> None:
        self.buffer.clear()
        await self.send(server_event("input_audio_buffer.cleared"))

    async def _commit(self, turn: Turn, item_id: str, respond: bool, guess: _Guess | None = None) -> None:
        """Add ``turn`` as a user item, have the listener hear it (``guess``: already under way),
        and answer it when ``respond``."""
        self._turn_item = None
        previous = next(reversed(self.items), None)
        item = Item(id=item_id, role="user", content=[Content(type="input_audio", transcript=None)])
        await self.send(
            server_event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        )
        await self._add(item, previous)
        span = guess.span if guess is not None else self._turn_span(item_id)
        heard = guess.heard if guess is not None else self._listening(turn, span)
        self._spawn(self._hear(item, turn, respond, span, heard))

    def _listening(self, turn: Turn, span: Span) -> asyncio.Task[Transcript]:
        """The listener's transcript of ``turn``, under way (its request in ``span``'s trace)."""
        t = self.config.audio.input.transcription
        listen = Transcription(
            pcm16=turn.pcm16, language=t.language if t else None, prompt=(t.prompt or "") if t else ""
        )

        async def heard() -> Transcript:
            return await transcript_once(
                await self.submitter.listen(listen, self.config.model, _arrival(span))
            )

        task = asyncio.ensure_future(heard())
        task.add_done_callback(
            lambda t: t.cancelled() or t.exception()
        )  # a dropped guess's failure is no one's
        return task

    def _turn_span(self, item_id: str) -> Span:
        """The root span of a spoken turn: its listener's request and its response are in it."""
        attributes = {"omnirelay.realtime.session": self.config.id, "omnirelay.realtime.item": item_id}
        return start_span("realtime turn", Context(), SpanKind.SERVER, attributes)

    async def _hear(
        self, item: Item, turn: Turn, respond: bool, span: Span, heard: asyncio.Task[Transcript]
    ) -> None:
        """The listener's transcript (``heard``) of ``turn`` into ``item``; then the response, when
        asked (which ends ``span``, the turn's)."""
        answered = False
        try:
            if await self._transcribe(item, heard) and respond:
                await self._respond(ResponseCreate(type="response.create"), turn.arrived_s, span)
                answered = True
        except BadEvent as e:  # a response is under way: this turn gets none
            await self.send(error_event(e))
        finally:
            if not answered:
                span.end()

    async def _transcribe(self, item: Item, listening: asyncio.Task[Transcript]) -> bool:
        """Fill ``item``'s transcript from the listener and tell the client; False when it failed."""
        try:
            heard = await listening
        except APIError as err:
            await self.send(
                server_event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item.id,
                    content_index=0,
                    error={"type": "server_error", "code": err.code, "message": err.message},
                )
            )
            return False
        item.content[0].transcript = heard.text
        for seg in heard.segments:
            await self.send(
                server_event(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=item.id,
                    content_index=0,
                    delta=seg.text,
                )
            )
        await self.send(
            server_event(
                "conversation.item.input_audio_transcription.completed",
                item_id=item.id,
                content_index=0,
                transcript=heard.text,
                usage={"type": "duration", "seconds": round(heard.heard.end_s, 3)},
            )
        )
        return True

    # --- the conversation ----------------------------------------------------------------------
    async def _add(self, item: Item, previous: str | None) -> None:
        """Put ``item`` after ``previous`` (None: last; ``root``: first) and tell the client."""
        if previous not in (None, "root") and previous not in self.items:
            raise BadEvent(f"no item '{previous}' in the conversation", "item_not_found", "previous_item_id")
        if item.id in self.items:
            raise BadEvent(
                f"an item '{item.id}' is in the conversation already", "duplicate_item_id", "item.id"
            )
        order = list(self.items.items())
        at = (
            len(order)
            if previous is None
            else 0
            if previous == "root"
            else [k for k, _ in order].index(previous) + 1
        )
        order.insert(at, (item.id, item))
        self.items = dict(order[-MAX_ITEMS:])
        await self.send(server_event("conversation.item.added", previous_item_id=previous, item=item.shown()))
        await self.send(server_event("conversation.item.done", previous_item_id=previous, item=item.shown()))

    async def _create_item(self, e: ItemCreate) -> None:
        item = e.item
        audio = [c for c in item.content if c.type == "input_audio" and c.audio]
        if audio and item.role != "user":
            raise BadEvent("only a user item may carry input audio", "invalid_value", "item.content")
        await self._add(item, e.previous_item_id)
        if audio:  # heard like a spoken turn (the thinker takes text)
            decoded = InputBuffer(self.config.audio.input.format.type, None)
            for c in audio:
                decoded.append(base64.b64decode(c.audio or ""))
                c.audio = None
            turn, span = decoded.commit(), self._turn_span(item.id)
            self._spawn(self._hear(item, turn, False, span, self._listening(turn, span)))

    async def _delete(self, e: ItemDelete) -> None:
        if self.items.pop(e.item_id, None) is None:
            raise BadEvent(f"no item '{e.item_id}' in the conversation", "item_not_found", "item_id")
        await self.send(server_event("conversation.item.deleted", item_id=e.item_id))

    async def _retrieve(self, e: ItemRetrieve) -> None:
        item = self.items.get(e.item_id)
        if item is None:
            raise BadEvent(f"no item '{e.item_id}' in the conversation", "item_not_found", "item_id")
        await self.send(server_event("conversation.item.retrieved", item=item.shown()))

    async def _truncate(self, e: ItemTruncate) -> None:
        item = self.items.get(e.item_id)
        if item is None or item.role != "assistant" or e.content_index >= len(item.content):
            raise BadEvent(
                f"no assistant audio '{e.item_id}' content {e.content_index}", "item_not_found", "item_id"
            )
        sent = self.response.audio_ms if self.response is not None and self.response.item is item else None
        if sent is not None and e.audio_end_ms > sent:
            raise BadEvent(
                f"audio_end_ms {e.audio_end_ms} is past the item's audio ({sent} ms)",
                "invalid_value",
                "audio_end_ms",
            )
        await self._truncated(item, e.content_index, e.audio_end_ms)

    async def _truncated(self, item: Item, content_index: int, audio_end_ms: int) -> None:
        await self.send(
            server_event(
                "conversation.item.truncated",
                item_id=item.id,
                content_index=content_index,
                audio_end_ms=audio_end_ms,
            )
        )

    # --- responses -----------------------------------------------------------------------------
    async def _create_response(self, e: ResponseCreate) -> None:
        await self._respond(e)

    async def _respond(
        self, e: ResponseCreate, turn_end_s: float | None = None, span: Span | None = None
    ) -> None:
        """Start a response (``turn_end_s``: when the spoken turn it answers ended; ``span``: that
        turn's, which the response ends)."""
        if self.response is not None:
            raise BadEvent(
                "a response is under way: cancel it or wait for response.done",
                "conversation_already_has_active_response",
            )
        p, c = e.response, self.config
        modalities = p.output_modalities or c.output_modalities
        audio_cfg = p.audio or c.audio
        plan = ResponsePlan(
            audio="audio" in modalities,
            output_format=audio_cfg.output.format.type,
            voice=audio_cfg.output.voice,
            max_output_tokens=p.max_output_tokens or c.max_output_tokens,
            metadata=p.metadata,
        )
        if plan.audio:
            self._check_voice(plan.voice)
        response = self.response = Response(plan)
        self.items[response.item.id] = response.item
        await self.send(server_event("response.created", response=response.shown("in_progress")))
        messages = self._messages(p.instructions if p.instructions is not None else c.instructions, p)
        response.task = self._spawn(self._run(response, messages, turn_end_s, span))

    def _messages(self, instructions: str, p: Any) -> list[dict[str, str]]:
        items = list(p.input or []) if p.conversation == "none" else [*self.items.values(), *(p.input or [])]
        out = [{"role": "system", "content": instructions}] if instructions else []
        return out + [{"role": i.role, "content": i.text()} for i in items if i.text()]

    async def _run(
        self, response: Response, messages: list[dict[str, str]], turn_end_s: float | None, span: Span | None
    ) -> None:
        plan = response.plan
        max_tokens = plan.max_output_tokens if isinstance(plan.max_output_tokens, int) else None
        try:
            response.job = await self.submitter.conversation(
                messages, self.config.model, _arrival(span), plan.voice if plan.audio else None, max_tokens
            )
            if response.ended:  # cancelled while it was being admitted
                responses.stop(response, "cancelled")
                return

            def first_audio(r: Response) -> None:
                if turn_end_s is not None:
                    self.metrics.voice_to_voice(time.monotonic() - turn_end_s)

            await responses.stream(response, self.send, first_audio)
        except APIError as err:
            await responses.conclude(response, self.send, "failed", responses.failed_details(err))
        finally:
            if self.response is response:
                self.response = None
            if span is not None:
                span.end()

    async def _cancel_event(self, e: ResponseCancel) -> None:
        r = self.response
        if r is None or (e.response_id is not None and e.response_id != r.id):
            raise BadEvent("no response under way to cancel", "response_cancel_not_active", "response_id")
        await self._cancel(r, "client_cancelled")

    async def _cancel(self, r: Response, reason: str) -> None:
        """Stop ``r`` in every stage and end it ``cancelled``; on barge-in the assistant item's audio
        ends where the audio sent to the client ended."""
        self.response = None
        responses.stop(r, "cancelled")
        self.metrics.interrupted(reason)
        await responses.conclude(r, self.send, "cancelled", {"type": "cancelled", "reason": reason})
        if reason == "turn_detected" and r.plan.audio:
            await self._truncated(r.item, 0, r.audio_ms)

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("realtime session task failed", exc_info=task.exception())


@dataclass
class _Guess:
    """A transcription begun at a pause in the caller's speech that ended at ``end_ms``."""

    end_ms: int
    span: Span
    heard: asyncio.Task[Transcript]


def _arrival(parent: Span | None) -> Arrival:
    """A request the session makes now, in ``parent``'s trace (a trace of its own without one)."""
    trace_parent = set_span_in_context(parent) if parent is not None else Context()
    return Arrival(time.time_ns(), time.monotonic(), trace_parent)


_HANDLERS: dict[type, Callable[[RealtimeSession, Any], Awaitable[None]]] = {
    SessionUpdate: RealtimeSession._update,
    AudioAppend: RealtimeSession._append,
    AudioCommit: RealtimeSession._commit_now,
    AudioClear: RealtimeSession._clear,
    ItemCreate: RealtimeSession._create_item,
    ItemDelete: RealtimeSession._delete,
    ItemRetrieve: RealtimeSession._retrieve,
    ItemTruncate: RealtimeSession._truncate,
    ResponseCreate: RealtimeSession._create_response,
    ResponseCancel: RealtimeSession._cancel_event,
}
