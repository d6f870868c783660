"""From a validated API request to a submitted :class:`Job` (the request is queued on the bus)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from libs.common.envelopes import Admission, Sampling
from libs.common.pipeline import PipelineConfig
from libs.common.tracing import inject_headers, start_span, trace_id_hex
from services.gateway.errors import APIError
from services.gateway.pipeline_client import PipelineClient
from services.gateway.prompting import (
    Tokenizer,
    audio_voice,
    chat_messages,
    max_tokens_for,
    reject_unsupported,
    sampling_for,
    wants_audio,
)
from services.gateway.request_stats import GatewayStatLogger, RequestStats
from services.gateway.responses import Job
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest


class Submitter:
    def __init__(
        self,
        pipeline: PipelineConfig,
        client: PipelineClient,
        tokenizer: Tokenizer,
        stat_log: GatewayStatLogger,
    ) -> None:
        self.pipeline = pipeline
        self.client = client
        self.tokenizer = tokenizer
        self.stat_log = stat_log
        self.max_model_len = pipeline.stages[0].engine.max_model_len

    def _check_model(self, model: str) -> None:
        if model != self.pipeline.served_model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.pipeline.served_model_name}'",
                "model_not_found",
                "model",
            )

    async def chat(self, req: ChatCompletionRequest, arrival: Arrival) -> Job:
        self._check_model(req.model)
        reject_unsupported(req)
        audio = wants_audio(req, self.pipeline)
        voice = audio_voice(audio, self.pipeline) if audio else None
        ids = self.tokenizer.chat(chat_messages(req.messages))
        asked, param = (
            (req.max_completion_tokens, "max_completion_tokens")
            if req.max_completion_tokens is not None
            else (req.max_tokens, "max_tokens")
        )
        sampling = sampling_for(req, max_tokens_for(asked, len(ids), self.max_model_len, param))
        job = await self._submit(
            "chatcmpl", ids, sampling, audio is not None, req.stream, arrival, req.model, "chat", voice
        )
        job.audio_format = audio.format if audio else None
        job.return_token_ids = req.return_token_ids
        return job

    async def completion(self, req: CompletionRequest, arrival: Arrival) -> Job:
        self._check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "exactly one prompt per request is supported", "invalid_request", "prompt")
        if req.echo:
            raise APIError(400, "'echo' is not supported by this server", "unsupported_parameter", "echo")
        ids = self.tokenizer.text(prompts[0])
        sampling = sampling_for(
            req, max_tokens_for(req.max_tokens, len(ids), self.max_model_len, "max_tokens")
        )
        job = await self._submit(
            "cmpl", ids, sampling, False, req.stream, arrival, req.model, "text_completion"
        )
        job.return_token_ids = req.return_token_ids
        return job

    async def _submit(
        self,
        prefix: str,
        ids: list[int],
        sampling: Sampling,
        audio: bool,
        streamed: bool,
        arrival: Arrival,
        model: str,
        operation: str,
        voice: str | None = None,
    ) -> Job:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        span = start_span(
            f"{operation} {model}",
            arrival.trace_parent,
            SpanKind.SERVER,
            {
                "http.request.method": "POST",
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "omnirelay.request_id": request_id,
                "omnirelay.audio": audio,
            },
            start_time=arrival.wall_ns,
        )
        adm = Admission(
            request_id=request_id,
            gateway_id=self.client.gateway_id,
            arrival_ns=arrival.wall_ns,
            deadline_ns=arrival.wall_ns + int(self.pipeline.request_timeout_s * 1e9),
            prompt_token_ids=ids,
            sampling=sampling,
            audio=audio,
            trace_id=trace_id_hex(span),
            voice=voice,
        )
        headers: dict[str, str] = {}
        inject_headers(headers, span)
        try:
            handle = await self.client.submit(adm, trace_headers=headers)
        except APIError as e:
            self.stat_log.rejected(e.code or "rejected")
            span.set_status(Status(StatusCode.ERROR, e.code or "rejected"))
            span.end()
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
        )


@dataclass(frozen=True)
class Arrival:
    """When the HTTP request arrived: wall clock (ns, the cross-service anchor) and monotonic (s)."""

    wall_ns: int
    mono_s: float
    trace_parent: Context | None = None
    """Trace context the client sent (``traceparent``), if any."""
