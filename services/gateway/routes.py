"""HTTP routes of the gateway: thin functions over :class:`Submitter` and the response builders."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from libs.common.envelopes import ClientEvent, ClientEventType
from libs.common.pipeline import TALKER_VOICES
from libs.common.tracing import context_from_headers
from libs.common.voices import OPENAI_VOICES, default_voice, talker_config
from services.gateway.audio_input import decode_audio, duration_s
from services.gateway.auth import authorize
from services.gateway.limits import admit
from services.gateway.responses import (
    AUDIO_EXPIRY_S,
    Collected,
    Job,
    audio_message,
    collect,
    guarded,
    sse_stream,
    until_started,
)
from services.gateway.schemas import (
    AssistantMessage,
    AudioOut,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    Health,
    ModelCard,
    ModelList,
    SpeechRequest,
    TranscriptionForm,
    VoiceCard,
    VoiceList,
)
from services.gateway.speech import SpeechEncoding, speech_events, speech_file
from services.gateway.submission import Arrival
from services.gateway.transcription import TranscriptEvents, transcript_of, transcription_body

router = APIRouter()
"""Open routes: liveness (``/health``). ``/metrics`` and Prometheus's service discovery are on the
admin listener (:mod:`services.gateway.admin`), not on this public port."""
api = APIRouter(dependencies=[Depends(authorize), Depends(admit)])
"""The OpenAI API (``/v1/*``): every route needs a valid API key (:func:`authorize`) and a slot
of its key's concurrency (:func:`admit`)."""
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _arrival(request: Request) -> Arrival:
    state = request.scope.get("state", {})
    return Arrival(
        state.get("arrival_ns") or time.time_ns(),
        state.get("arrival_s") or time.monotonic(),
        context_from_headers(request.headers),
    )


@api.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    p = request.app.state.pipeline
    card = ModelCard(
        id=p.served_model_name,
        created=request.app.state.started,
        max_model_len=p.thinker.engine.max_model_len,
    )
    return ModelList(data=[card])


@api.get("/v1/audio/voices")
async def list_voices(request: Request) -> VoiceList:
    talker = talker_config(request.app.state.pipeline)
    default = default_voice(talker) if talker is not None else None
    names = TALKER_VOICES[talker.protocol] if talker is not None else ()
    return VoiceList(
        data=[VoiceCard(id=v, default=v == default) for v in names],
        openai_names=list(OPENAI_VOICES) if names else [],
    )


@router.get("/health", response_model=Health)
async def health(request: Request) -> JSONResponse:
    h = request.app.state.client.health()
    return JSONResponse(h.model_dump(), status_code=503 if h.status == "unavailable" else 200)


# --- a streamed text delta's chunk, pre-rendered per request ------------------------------------
_MARK = "<delta>"
"""Stands for the delta's text when a request's chunk is rendered once by pydantic."""
_json_str = json.JSONEncoder(ensure_ascii=False).encode
"""A str as a JSON string, escaped as pydantic's ``model_dump_json`` escapes it (UTF-8 kept)."""


class DeltaChunks:
    """The chunks of one request's text deltas: its chunk is rendered once through the schemas'
    pydantic models (:func:`_chat_chunk`, :func:`_completion_chunk`: the reference) with a
    marker for the text, and per token only the text is JSON-escaped into it (and the token ids
    written), so no model is built per token. The same bytes as the reference (proven by
    ``tests/unit/test_gateway_sse_chunks.py``): the marker is cut at its last occurrence, and after
    it come only fixed keys and the ids, so an id or model name that holds the marker is kept."""

    __slots__ = ("_head", "_ids_close", "_ids_open", "_tail")

    def __init__(self, reference: Callable[[str, list[int] | None], str]) -> None:
        """``reference(text, token_ids)``: the pydantic rendering of a delta's chunk."""
        marker = _json_str(_MARK)
        self._head, _, self._tail = reference(_MARK, None).rpartition(marker)
        ids_open, _, ids_close = reference(_MARK, []).rpartition(marker)[2].rpartition("[]")
        self._ids_open, self._ids_close = f"{ids_open}[", f"]{ids_close}"

    def __call__(self, text: str, token_ids: list[int] | None) -> str:
        """The chunk of one delta (``token_ids`` None: the chunk has none)."""
        if token_ids is None:
            return f"{self._head}{_json_str(text)}{self._tail}"
        ids = ",".join(map(str, token_ids))
        return f"{self._head}{_json_str(text)}{self._ids_open}{ids}{self._ids_close}"


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _sse(job: Job, head: list[str], render, tail) -> StreamingResponse:
    return StreamingResponse(
        sse_stream(job, head, render, tail), media_type="text/event-stream", headers=SSE_HEADERS
    )


# --- speech -----------------------------------------------------------------------------------
@api.post("/v1/audio/speech")
async def audio_speech(body: SpeechRequest, request: Request) -> StreamingResponse:
    """OpenAI's text to speech: the input enters at the talker; the audio streams back in the
    asked format as it is encoded (``stream_format: audio``) or as speech events (``sse``). The
    response begins with the first audio, so a failure before it is an HTTP error."""
    encoding = SpeechEncoding(body.response_format, body.speed)
    job = await request.app.state.submitter.speech(body, _arrival(request))
    request.state.job = job
    await until_started(request, job)
    if body.stream_format == "sse":
        return StreamingResponse(
            speech_events(job, encoding), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return StreamingResponse(
        speech_file(job, encoding), media_type=encoding.content_type, headers=SSE_HEADERS
    )


# --- transcriptions ---------------------------------------------------------------------------
@api.post("/v1/audio/transcriptions")
async def audio_transcriptions(form: Annotated[TranscriptionForm, Form()], request: Request) -> Response:
    """OpenAI's speech to text: the audio enters at the listener; the transcript comes back in
    the asked format, or streamed as transcript events (``stream``)."""
    pcm16 = await asyncio.to_thread(decode_audio, await form.file.read(), "file")
    job = await request.app.state.submitter.transcription(form, pcm16, _arrival(request))
    request.state.job = job
    if form.stream:
        await until_started(request, job)
        events = TranscriptEvents(duration_s(pcm16))
        return _sse(job, [], events.render, events.tail)
    t = await guarded(request, job, transcript_of(job))
    return transcription_body(t, form.response_format, form.temperature)


# --- chat -------------------------------------------------------------------------------------
@api.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    job = await request.app.state.submitter.chat(body, _arrival(request))
    request.state.job = job
    if body.stream:
        await until_started(request, job)
        usage = _include_usage(body)
        head = [_chat_chunk(job, Delta(role="assistant", content=""))]
        deltas = _chat_deltas(job)
        return _sse(job, head, lambda ev: _chat_render(job, deltas, ev), lambda c: _chat_tail(job, c, usage))
    return await guarded(request, job, _chat_body(job))


async def _chat_body(job: Job) -> ChatCompletion:
    c = await collect(job)
    if job.audio_format:
        message = AssistantMessage(content=None, audio=audio_message(job, c))
    else:
        message = AssistantMessage(content="".join(c.text))
    choice = ChatChoice(
        message=message,
        finish_reason=c.finish_reason,
        token_ids=c.token_ids if job.return_token_ids else None,
    )
    return ChatCompletion(id=job.id, created=job.created, model=job.model, choices=[choice], usage=c.usage)


def _chat_chunk(
    job: Job, delta: Delta, finish_reason: str | None = None, token_ids: list[int] | None = None
) -> str:
    chunk = ChatCompletionChunk(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=[ChunkChoice(delta=delta, finish_reason=finish_reason, token_ids=token_ids)],
    )
    return chunk.model_dump_json(exclude_none=True)


def _chat_delta(job: Job, text: str) -> Delta:
    """A text delta of a chat stream: ``content``, or the transcript of an audio answer."""
    if job.audio_format:
        return Delta(audio=AudioOut(id=job.audio_id, transcript=text))
    return Delta(content=text)


def _chat_deltas(job: Job) -> DeltaChunks:
    return DeltaChunks(lambda text, ids: _chat_chunk(job, _chat_delta(job, text), token_ids=ids))


def _chat_render(job: Job, deltas: DeltaChunks, ev: ClientEvent) -> list[str]:
    if ev.type == ClientEventType.TEXT:
        return [deltas(ev.text, ev.token_ids if job.return_token_ids else None)]
    if ev.type == ClientEventType.AUDIO:
        data = base64.b64encode(ev.pcm16).decode()
        audio = AudioOut(id=job.audio_id, data=data, expires_at=int(time.time()) + AUDIO_EXPIRY_S)
        return [_chat_chunk(job, Delta(audio=audio))]
    return []


def _chat_tail(job: Job, c: Collected, include_usage: bool) -> list[str]:
    out = [_chat_chunk(job, Delta(), finish_reason=c.finish_reason)]
    if include_usage:
        out.append(
            ChatCompletionChunk(
                id=job.id, created=job.created, model=job.model, choices=[], usage=c.usage
            ).model_dump_json(exclude_none=True)
        )
    return out


# --- completions -------------------------------------------------------------------------------
@api.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request):
    job = await request.app.state.submitter.completion(body, _arrival(request))
    request.state.job = job
    if body.stream:
        await until_started(request, job)
        usage = _include_usage(body)
        deltas = _completion_deltas(job)
        return _sse(
            job, [], lambda ev: _completion_render(job, deltas, ev), lambda c: _completion_tail(job, c, usage)
        )
    return await guarded(request, job, _completion_body(job))


async def _completion_body(job: Job) -> Completion:
    c = await collect(job)
    choice = CompletionChoice(
        text="".join(c.text),
        finish_reason=c.finish_reason,
        token_ids=c.token_ids if job.return_token_ids else None,
    )
    return Completion(id=job.id, created=job.created, model=job.model, choices=[choice], usage=c.usage)


def _completion_chunk(job: Job, choices: list[CompletionChoice], usage=None) -> str:
    return Completion(
        id=job.id, created=job.created, model=job.model, choices=choices, usage=usage
    ).model_dump_json(exclude_none=True)


def _completion_deltas(job: Job) -> DeltaChunks:
    return DeltaChunks(
        lambda text, ids: _completion_chunk(
            job, [CompletionChoice(text=text, finish_reason=None, token_ids=ids)]
        )
    )


def _completion_render(job: Job, deltas: DeltaChunks, ev: ClientEvent) -> list[str]:
    if ev.type != ClientEventType.TEXT:
        return []
    return [deltas(ev.text, ev.token_ids if job.return_token_ids else None)]


def _completion_tail(job: Job, c: Collected, include_usage: bool) -> list[str]:
    out = [_completion_chunk(job, [CompletionChoice(text="", finish_reason=c.finish_reason)])]
    if include_usage:
        out.append(_completion_chunk(job, [], usage=c.usage))
    return out


router.include_router(api)
