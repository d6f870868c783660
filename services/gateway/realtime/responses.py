"""One realtime response: the pipeline's events of its request turned into OpenAI's response
events, in order — ``response.created``, the assistant item and its content part, the deltas
(``response.output_text.delta``, or ``response.output_audio_transcript.delta`` and
``response.output_audio.delta``), their ``.done`` events, ``response.done`` with ``status`` and
``usage``.

A response ends ``completed``, ``cancelled`` (``response.cancel``, or the caller's speech: barge-in;
the request is aborted in every stage), or ``failed`` (the pipeline's error in ``status_details``).
The assistant item's audio ends where the audio sent to the client ends: a cancelled response's item
is ``incomplete`` with the audio it had.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from libs.common.envelopes import ClientEventType
from libs.common.playback import AudioChunk
from services.gateway.errors import APIError
from services.gateway.realtime.audio_formats import OutputEncoder, duration_ms
from services.gateway.realtime.protocol import Content, Item, server_event
from services.gateway.responses import Job, abort_reason, events_until_done, finish

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class ResponsePlan:
    """What a response is asked to be: its modality and audio format (the session's, or
    ``response.create``'s overrides), and its voice."""

    audio: bool
    output_format: str
    voice: str
    max_output_tokens: int | str
    metadata: dict[str, str] | None = None


@dataclass
class Response:
    """A response under way."""

    plan: ResponsePlan
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex[:24]}")
    item: Item = field(default_factory=lambda: Item(role="assistant", status="in_progress"))
    job: Job | None = None
    task: asyncio.Task[None] | None = None
    text: list[str] = field(default_factory=list)
    audio_bytes: int = 0
    """Bytes of audio sent to the client (in the output format)."""
    first_audio_s: float | None = None
    """When its first audio delta was sent (``time.monotonic()``)."""
    usage: dict[str, Any] | None = None
    ended: bool = False

    @property
    def audio_ms(self) -> int:
        return int(duration_ms(self.audio_bytes, self.plan.output_format))

    def shown(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object of ``response.created`` / ``response.done``."""
        out: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [self.item.shown()] if status != "in_progress" else [],
            "output_modalities": ["audio" if self.plan.audio else "text"],
            "max_output_tokens": self.plan.max_output_tokens,
            "conversation_id": "conv_default",
            "metadata": self.plan.metadata,
            "usage": self.usage,
        }
        if self.plan.audio:
            out["audio"] = {"output": {"format": {"type": self.plan.output_format}, "voice": self.plan.voice}}
        return out

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}


async def stream(response: Response, send: Send, on_first_audio: Callable[[Response], None]) -> None:
    """Send ``response``'s events as its request's events come, up to ``response.done``."""
    assert response.job is not None
    job, where = response.job, response._where()
    audio = response.plan.audio
    part = {"type": "audio", "transcript": ""} if audio else {"type": "text", "text": ""}
    await send(
        server_event(
            "response.output_item.added", response_id=response.id, output_index=0, item=response.item.shown()
        )
    )
    await send(server_event("conversation.item.added", previous_item_id=None, item=response.item.shown()))
    await send(server_event("response.content_part.added", part=part, **where))
    encoder = OutputEncoder(response.plan.output_format) if audio else None
    text_delta = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
    async for ev in events_until_done(job):
        if ev.type == ClientEventType.TEXT and ev.text:
            response.text.append(ev.text)
            await send(server_event(text_delta, delta=ev.text, **where))
        elif ev.type == ClientEventType.AUDIO and encoder is not None:
            job.stats.audio_chunks.append(AudioChunk(time.monotonic(), len(ev.pcm16)))  # the audio metrics
            await _audio(response, encoder.push(ev.pcm16), send, on_first_audio)
        elif ev.type == ClientEventType.TEXT_DONE and ev.usage is not None:
            response.usage = _usage(ev.usage.prompt_tokens, ev.usage.completion_tokens)
    if encoder is not None:
        await _audio(response, encoder.flush(), send, on_first_audio)
    job.client.release(job.id)
    finish(job, time.monotonic())
    await conclude(response, send, "completed")


async def _audio(
    response: Response, data: bytes, send: Send, on_first_audio: Callable[[Response], None]
) -> None:
    if not data:
        return
    response.audio_bytes += len(data)
    await send(
        server_event(
            "response.output_audio.delta", delta=base64.b64encode(data).decode(), **response._where()
        )
    )
    if response.first_audio_s is None:
        response.first_audio_s = time.monotonic()
        on_first_audio(response)


async def conclude(
    response: Response, send: Send, status: str, details: dict[str, Any] | None = None
) -> None:
    """Send the ``.done`` events and ``response.done`` (once); the item keeps what was sent."""
    if response.ended:
        return
    response.ended = True
    where, text = response._where(), "".join(response.text)
    audio = response.plan.audio
    response.item.status = "completed" if status == "completed" else "incomplete"
    response.item.content = [
        Content(type="output_audio", transcript=text) if audio else Content(type="output_text", text=text)
    ]
    if audio:
        await send(server_event("response.output_audio.done", **where))
        await send(server_event("response.output_audio_transcript.done", transcript=text, **where))
    else:
        await send(server_event("response.output_text.done", text=text, **where))
    part = {"type": "audio", "transcript": text} if audio else {"type": "text", "text": text}
    await send(server_event("response.content_part.done", part=part, **where))
    await send(
        server_event(
            "response.output_item.done", response_id=response.id, output_index=0, item=response.item.shown()
        )
    )
    await send(server_event("conversation.item.done", previous_item_id=None, item=response.item.shown()))
    await send(server_event("response.done", response=response.shown(status, details)))


def stop(response: Response, reason: str) -> None:
    """Abort ``response``'s request in every stage and stop streaming it (``reason``: why). A
    response whose request is still being admitted is left to finish that: its runner stops it as
    soon as the request exists (it sees the response ended), so no admitted request is orphaned."""
    job = response.job
    if job is None:
        return
    if not job.abandoned:
        job.abandoned = True
        job.client.abort(job.id, reason)
        job.stats.finished_reason = "abort"
        finish(job, time.monotonic())
    if response.task is not None and not response.task.done() and response.task is not asyncio.current_task():
        response.task.cancel()


def failed_details(e: BaseException) -> dict[str, Any]:
    """``status_details`` of a response whose request failed."""
    if isinstance(e, APIError):
        return {
            "type": "failed",
            "error": {
                "type": "server_error" if e.status >= 500 else "invalid_request_error",
                "code": e.code,
                "message": e.message,
            },
        }
    return {
        "type": "failed",
        "error": {"type": "server_error", "code": abort_reason(e), "message": "the response failed"},
    }


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "total_tokens": prompt + completion,
        "input_tokens": prompt,
        "output_tokens": completion,
        "input_token_details": {"text_tokens": prompt, "audio_tokens": 0, "cached_tokens": 0},
        "output_token_details": {"text_tokens": completion, "audio_tokens": 0},
    }
