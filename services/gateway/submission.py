"""From a validated API request to a submitted :class:`Job` (the request is queued on the bus)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
import uuid
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from pydantic import BaseModel

from libs.common.envelopes import Admission, Sampling, SpeechChunk, Transcription
from libs.common.pipeline import PipelineConfig
from libs.common.tracing import inject_headers, start_span, trace_id_hex
from services.gateway.audio_input import decode_audio, duration_s
from services.gateway.errors import APIError, bad_request
from services.gateway.limits import DEFAULT_LIMITS, InputLimits, check_text
from services.gateway.pipeline_client import PipelineClient
from services.gateway.prompting import (
    Tokenizer,
    audio_parts,
    audio_voice,
    chat_messages,
    max_tokens_for,
    reject_unsupported,
    sampling_for,
    voice_of,
    wants_audio,
)
from services.gateway.request_stats import GatewayStatLogger, RequestStats
from services.gateway.responses import Job
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InputAudio,
    SpeechRequest,
    TranscriptionForm,
)
from services.gateway.speech_input import speech_chunks
from services.gateway.transcription import transcript_once


class Submitter:
    def __init__(
        self,
        pipeline: PipelineConfig,
        client: PipelineClient,
        tokenizer: Tokenizer,
        stat_log: GatewayStatLogger,
        limits: InputLimits = DEFAULT_LIMITS,
    ) -> None:
        self.pipeline = pipeline
        self.client = client
        self.tokenizer = tokenizer
        self.stat_log = stat_log
        self.limits = limits
        self.max_model_len = pipeline.thinker.engine.max_model_len

    def _budget(self, asked: int | None, prompt_len: int, param: str) -> int:
        """The request's generation budget (:func:`max_tokens_for`: past the context is
        ``context_length_exceeded``), at most the server's cap (asked past it: 400)."""
        budget = max_tokens_for(asked, prompt_len, self.max_model_len, param)
        self.limits.check_max_tokens(asked, param)
        return min(budget, self.limits.max_tokens)

    def _entry(self, stage: int | None, lacks: str, code: str, param: str = "model") -> int:
        """``stage``, where a request enters; a 400 (``code`` on ``param``) when the pipeline
        has no such stage (``lacks`` says which, and what the request cannot do)."""
        if stage is None:
            raise bad_request(f"pipeline '{self.pipeline.name}' has no {lacks}", param, code)
        return stage

    def check_model(self, model: str) -> None:
        if model != self.pipeline.served_model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.pipeline.served_model_name}'",
                "model_not_found",
                "model",
            )

    async def chat(self, req: ChatCompletionRequest, arrival: Arrival) -> Job:
        """``/v1/chat/completions``: the conversation, its audio parts transcribed first by the
        listener (:meth:`_heard`), templated into the thinker's prompt, entering at the thinker."""
        check_text(_fields(req))
        self.check_model(req.model)
        reject_unsupported(req)
        self.limits.check_messages(len(req.messages))
        self.limits.check_sampling(req.stop, req.ignore_eos)
        parts = audio_parts(req.messages)
        if parts:
            self._entry(
                self.pipeline.listener_stage,
                "listener stage: it cannot take audio input",
                "unsupported_content",
                "messages",
            )
        audio = wants_audio(req, self.pipeline)
        voice = audio_voice(audio, self.pipeline) if audio else None
        request_id, span = self._open("chatcmpl", "chat", req.model, arrival, audio is not None)
        try:
            messages = chat_messages(req.messages, await self._heard(parts, req.model, arrival, span))
            ids, sampling = await self._chat_prompt(req, messages)
            span.set_attributes(_sampling_attributes(sampling))
            job = await self._admit(
                request_id,
                span,
                req.model,
                req.stream,
                arrival,
                entry_stage=self.pipeline.thinker_stage,
                prompt_token_ids=ids,
                sampling=sampling,
                audio=audio is not None,
                voice=voice,
            )
        except BaseException as e:
            _end_failed(span, e)
            raise
        job.audio_format = audio.format if audio else None
        job.return_token_ids = req.return_token_ids
        return job

    async def _chat_prompt(
        self, req: ChatCompletionRequest, messages: list[dict[str, str]]
    ) -> tuple[list[int], Sampling]:
        """The thinker's prompt tokens and sampling of a chat (its size and budget checked)."""
        self.limits.check_prompt(sum(len(m["content"]) for m in messages), "messages")
        asked, param = (
            (req.max_completion_tokens, "max_completion_tokens")
            if req.max_completion_tokens is not None
            else (req.max_tokens, "max_tokens")
        )
        # Off the event loop: a long prompt must not stall every other stream of this gateway.
        ids = await asyncio.to_thread(self.tokenizer.chat, messages)
        return ids, sampling_for(req, self._budget(asked, len(ids), param))

    async def completion(self, req: CompletionRequest, arrival: Arrival) -> Job:
        check_text(_fields(req))
        self.check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "exactly one prompt per request is supported", "invalid_request", "prompt")
        if req.echo:
            raise APIError(400, "'echo' is not supported by this server", "unsupported_parameter", "echo")
        self.limits.check_prompt(len(prompts[0]), "prompt")
        self.limits.check_sampling(req.stop, req.ignore_eos)
        ids = await asyncio.to_thread(self.tokenizer.text, prompts[0])
        sampling = sampling_for(req, self._budget(req.max_tokens, len(ids), "max_tokens"))
        job = await self._submit(
            "cmpl",
            "text_completion",
            req.model,
            req.stream,
            arrival,
            _sampling_attributes(sampling),
            entry_stage=self.pipeline.thinker_stage,
            prompt_token_ids=ids,
            sampling=sampling,
        )
        job.return_token_ids = req.return_token_ids
        return job

    async def speech(self, req: SpeechRequest, arrival: Arrival) -> Job:
        """``/v1/audio/speech``: the input enters the pipeline at its talker, cut into chunks
        (:func:`speech_chunks`), each with its tokens in the thinker's tokenizer."""
        check_text(_fields(req))
        self.check_model(req.model)
        self._entry(self.pipeline.speech_stage, "talker stage: it cannot speak", "speech_unsupported")
        voice = voice_of(req.voice_name, self.pipeline, "voice", "invalid_voice")
        chunks = await asyncio.to_thread(self._speech_chunks, req.input)
        if not chunks:
            raise bad_request("input has nothing to speak", "input", "empty_input")
        return await self.speak(chunks, voice, req.model, req.response_format.value, arrival)

    async def speak(
        self, chunks: list[SpeechChunk], voice: str | None, model: str, fmt: str, arrival: Arrival
    ) -> Job:
        """A speech request: ``chunks`` (each with its tokens in the thinker's tokenizer) enter
        the pipeline at its talker, spoken in ``voice`` (resolved) and encoded as ``fmt``."""
        entry = self._entry(self.pipeline.speech_stage, "talker stage: it cannot speak", "speech_unsupported")
        attributes = {"omnirelay.speech.format": fmt, "omnirelay.speech.chunks": len(chunks)}
        job = await self._submit(
            "speech",
            "speech",
            model,
            True,
            arrival,
            attributes,
            audio=True,
            voice=voice,
            entry_stage=entry,
            text_chunks=chunks,
        )
        job.audio_format, job.speech = fmt, True
        job.speech_tokens = sum(len(c.token_ids) for c in chunks)
        return job

    async def transcription(self, req: TranscriptionForm, pcm16: bytes, arrival: Arrival) -> Job:
        """``/v1/audio/transcriptions``: the audio (16 kHz PCM16, decoded by the route) enters
        the pipeline at its listener."""
        self.check_model(req.model)
        if "word" in req.timestamp_granularities:
            raise bad_request(
                "word timestamps are not supported; segment timestamps are",
                "timestamp_granularities[]",
                "unsupported_parameter",
            )
        listen = Transcription(
            pcm16=pcm16, language=req.language, prompt=req.prompt, temperature=req.temperature
        )
        return await self.listen(listen, req.model, arrival, req.stream)

    async def listen(
        self, listen: Transcription, model: str, arrival: Arrival, streamed: bool = False
    ) -> Job:
        """A transcription request: ``listen``'s audio enters the pipeline at its listener (a
        400 on ``model`` for a pipeline without one)."""
        entry = self._entry(
            self.pipeline.listener_stage, "listener stage: it cannot transcribe", "transcription_unsupported"
        )
        attributes = {"omnirelay.audio.input_s": duration_s(listen.pcm16)}
        return await self._submit(
            "transcr",
            "transcription",
            model,
            streamed,
            arrival,
            attributes,
            entry_stage=entry,
            transcription=listen,
        )

    async def conversation(
        self,
        messages: list[dict[str, str]],
        model: str,
        arrival: Arrival,
        voice_name: str | None,
        max_tokens: int | None,
    ) -> Job:
        """A realtime response: ``messages`` templated into the thinker's prompt, entering at the
        thinker; with a ``voice_name`` (audio out) the whole chain runs. Bad input is a
        :class:`APIError` (the session sends it as an ``error`` event)."""
        voice = None
        if voice_name is not None:
            if self.pipeline.audio_stage is None:
                raise bad_request(f"pipeline '{self.pipeline.name}' produces no audio", "output_modalities")
            voice = voice_of(voice_name, self.pipeline, "audio.output.voice")
        ids = await asyncio.to_thread(self.tokenizer.chat, messages)
        sampling = Sampling(max_tokens=self._budget(max_tokens, len(ids), "max_output_tokens"))
        job = await self._submit(
            "resp",
            "chat",
            model,
            True,
            arrival,
            _sampling_attributes(sampling),
            entry_stage=self.pipeline.thinker_stage,
            prompt_token_ids=ids,
            sampling=sampling,
            audio=voice_name is not None,
            voice=voice,
        )
        job.audio_format = "pcm16" if voice_name is not None else None  # its audio goes out as raw PCM16
        return job

    def voice(self, asked: str | None) -> str | None:
        """The talker's voice for ``asked`` (an unknown one is a 400 ``invalid_voice``)."""
        return voice_of(asked, self.pipeline, "voice", "invalid_voice")

    def _speech_chunks(self, text: str) -> list[SpeechChunk]:
        """The input's chunks (:func:`speech_chunks`) that have tokens, each with them."""
        chunks = [SpeechChunk(text=t, token_ids=self.tokenizer.words(t)) for t in speech_chunks(text)]
        return [c for c in chunks if c.token_ids]

    def _open(
        self,
        prefix: str,
        operation: str,
        model: str,
        arrival: Arrival,
        audio: bool,
        attributes: dict[str, str | int | float | bool] | None = None,
    ) -> tuple[str, Span]:
        """A new request id and its SERVER span (``operation``, ``model``, plus ``attributes``):
        the root of the request's trace, or a child of the trace the client (or, for a chat's
        audio, the chat) sent."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        span = start_span(
            f"{operation} {model}",
            arrival.trace_parent,
            SpanKind.SERVER,
            {
                "http.request.method": "POST",
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "omnirelay.request_id": request_id,
                "omnirelay.audio": audio,
                **(attributes or {}),
            },
            start_time=arrival.wall_ns,
        )
        return request_id, span

    async def _submit(
        self,
        prefix: str,
        operation: str,
        model: str,
        streamed: bool,
        arrival: Arrival,
        attributes: dict[str, str | int | float | bool],
        **admission: Any,
    ) -> Job:
        """Publish an :class:`Admission` with the ``admission`` fields for a new request (:meth:`_open`)."""
        audio = bool(admission.get("audio", False))
        request_id, span = self._open(prefix, operation, model, arrival, audio, attributes)
        return await self._admit(request_id, span, model, streamed, arrival, **admission)

    async def _admit(
        self, request_id: str, span: Span, model: str, streamed: bool, arrival: Arrival, **admission: Any
    ) -> Job:
        """Publish the :class:`Admission` of ``request_id`` with the ``admission`` fields."""
        audio = bool(admission.get("audio", False))
        adm = Admission(
            request_id=request_id,
            gateway_id=self.client.gateway_id,
            arrival_ns=arrival.wall_ns,
            deadline_ns=arrival.wall_ns + int(self.pipeline.request_timeout_s * 1e9),
            trace_id=trace_id_hex(span),
            **admission,
        )
        headers: dict[str, str] = {}
        inject_headers(headers, span)
        try:
            handle = await self.client.submit(adm, trace_headers=headers)
        except APIError as e:
            self.stat_log.rejected(e.code or "rejected")
            _end_failed(span, e)
            raise
        stats = RequestStats(arrival_s=arrival.mono_s, audio=audio, streamed=streamed, trace_id=adm.trace_id)
        self.stat_log.submitted(stats)
        return Job(
            handle=handle,
            client=self.client,
            model=model,
            created=int(time.time()),
            stats=stats,
            log=self.stat_log,
            span=span,
            max_buffered=self.limits.max_buffered_events,
        )

    async def _heard(
        self, parts: dict[tuple[int, int], InputAudio], model: str, arrival: Arrival, parent: Span
    ) -> dict[tuple[int, int], str]:
        """What the listener hears in each of a chat's audio parts, transcribed side by side, each
        a transcription request of its own in the chat's trace (a failure of one is the chat's)."""
        if not parts:
            return {}
        child = Arrival(arrival.wall_ns, arrival.mono_s, set_span_in_context(parent))

        async def heard(key: tuple[int, int], part: InputAudio) -> str:
            param = f"messages.{key[0]}.content.{key[1]}.input_audio.data"
            try:
                data = base64.b64decode(part.data, validate=True)
            except binascii.Error:
                raise bad_request("input_audio.data is not base64", param, "invalid_audio") from None
            pcm16 = await asyncio.to_thread(decode_audio, data, param)
            return (await transcript_once(await self.listen(Transcription(pcm16=pcm16), model, child))).text

        texts = await asyncio.gather(*(heard(k, p) for k, p in parts.items()))
        return dict(zip(parts, texts, strict=True))


def _fields(req: BaseModel) -> dict[str, Any]:
    """The request's fields the gateway reads (unknown ones, which it ignores, left out)."""
    return req.model_dump(exclude=set(req.model_extra or ()))


def _sampling_attributes(sampling: Sampling) -> dict[str, str | int | float | bool]:
    """The span attributes of a request's sampling parameters (OpenTelemetry's GenAI names)."""
    return {
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
    }


@dataclass(frozen=True)
class Arrival:
    """When the HTTP request arrived: wall clock (ns, the cross-service anchor) and monotonic (s)."""

    wall_ns: int
    mono_s: float
    trace_parent: Context | None = None
    """Trace context the client sent (``traceparent``), if any."""


def _end_failed(span: Span, e: BaseException) -> None:
    """End the SERVER span of a request that failed before it was queued (unless it has ended)."""
    if not span.is_recording():
        return
    span.set_status(Status(StatusCode.ERROR, getattr(e, "code", None) or type(e).__name__))
    span.end()
