"""Greedy chat completions as one client sees them (:class:`Seen`, filled by :func:`send`: token
ids, chunk arrival times, audio, errors), and the tiny pipeline with two replicas of every stage
(:data:`TWO_REPLICA_PIPELINE`) that ``omnirelay bench nice`` loads and the verification suites
(``tests/verification``: ``omnirelay verify faults|chaos``) inject faults into.

Clocks: ``time.monotonic()`` of this process, seconds.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from typing import Any

TWO_REPLICA_PIPELINE = """\
name: faults
served_model_name: faults-model
request_timeout_s: 120
stages:
  - {name: thinker, type: llm, model: tiny-thinker, replicas: 2, consumes: text, emits: text,
     stream_to_client: true, engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}}
  - {name: talker, type: llm, model: tiny-talker, replicas: 2, consumes: text, emits: codec_codes,
     engine: {max_model_len: 2048, enforce_eager: true, dtype: float32}}
  - {name: code2wav, type: codec, model: tiny-code2wav, replicas: 2, consumes: codec_codes,
     emits: audio, stream_to_client: true}
"""
MODEL = "faults-model"
"""The ``served_model_name`` of :data:`TWO_REPLICA_PIPELINE`."""


@dataclass
class Seen:
    """One client's request as it saw it (``time.monotonic()`` readings, seconds)."""

    id: str = ""
    """The request's id: its chunks', or the ``X-Request-Id`` of its error response."""
    token_ids: list[int] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    """When each chunk with tokens or audio arrived (a response not streamed: one arrival)."""
    usage_tokens: int | None = None
    """``usage.completion_tokens``."""
    finish_reason: str | None = None
    audio_bytes: int = 0
    error: str | None = None
    """A failure: the OpenAI error's ``code``, else the exception's type name."""
    ended_s: float | None = None
    sent_s: float | None = None
    text: str = ""
    """The text (``content``, or the audio's ``transcript``), as streamed or in the message."""
    audio_chunks: int = 0
    """Chunks with audio (a response not streamed: 1 when it has audio)."""
    error_code: str | None = None
    """A failure's OpenAI error ``code`` (None: the failure had none, or no failure)."""
    status: int | None = None
    """A failure's HTTP status, where it had one."""
    keep_audio: bool = False
    """Keep each audio chunk's PCM16 in :attr:`audio_pieces` (for the chunk judge)."""
    audio_pieces: list[bytes] = field(default_factory=list)
    """The PCM16 bytes of each audio chunk, in arrival order (only with :attr:`keep_audio`)."""
    heard: str = ""
    """A realtime session: the caller's turn as the listener transcribed it."""


AUDIO_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
"""The arguments of a request for audio (raw PCM16, 24 kHz) besides its text."""


def _chunk_seen(seen: Seen, chunk: dict[str, Any], now: float) -> None:
    """Add one streamed chunk (its JSON, arrived at ``now``) to ``seen``."""
    seen.id = chunk["id"]
    if chunk.get("choices"):
        choice = chunk["choices"][0]
        ids = choice.get("token_ids") or []
        delta = choice.get("delta") or {}
        audio = delta.get("audio") or {}
        data = audio.get("data")
        if ids or data:
            seen.at.append(now)
        seen.token_ids += ids
        seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
        seen.text += delta.get("content") or audio.get("transcript") or ""
        if data:
            pcm = base64.b64decode(data)
            seen.audio_bytes += len(pcm)
            seen.audio_chunks += 1
            if seen.keep_audio:
                seen.audio_pieces.append(pcm)
    if chunk.get("usage") is not None:
        seen.usage_tokens = chunk["usage"]["completion_tokens"]


def _message_seen(seen: Seen, r, now: float) -> None:
    """Add a whole response (not streamed, arrived at ``now``) to ``seen``."""
    seen.id = r.id
    message = r.choices[0].message
    seen.token_ids = (r.choices[0].model_extra or {}).get("token_ids") or []
    seen.finish_reason = r.choices[0].finish_reason
    data = message.audio.data if message.audio is not None else None
    seen.text = message.content or (message.audio.transcript if message.audio is not None else "") or ""
    if seen.token_ids or data:
        seen.at.append(now)
    if data:
        seen.audio_bytes, seen.audio_chunks = len(base64.b64decode(data)), 1
    seen.usage_tokens = r.usage.completion_tokens if r.usage is not None else None


async def send(
    client, model: str, seen: Seen, prompt: str, max_tokens: int, audio: bool = False, stream: bool = True
) -> None:
    """One greedy chat completion (``temperature: 0``, ``ignore_eos``, the token ids returned)
    through ``client`` (an ``openai.AsyncOpenAI``): what the client saw goes into ``seen``. A
    failure is recorded (its error code, else its type), never raised. A stream's chunks are read
    by the client's own SSE stream as JSON, not as its chunk models, which cost the client ~190 µs
    a chunk to build (results/testing/2026-12-06-suite-cpu-by-process.md)."""
    import openai
    from openai.types.chat import ChatCompletion

    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **(AUDIO_OUT if audio else {}),
    }
    seen.sent_s = time.monotonic()
    try:
        if not stream:
            r = await client.post("/chat/completions", cast_to=ChatCompletion, body=body)
            _message_seen(seen, r, time.monotonic())
        else:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            chunks = await client.post(
                "/chat/completions",
                cast_to=object,
                body=body,
                stream=True,
                stream_cls=openai.AsyncStream[object],
            )
            async for chunk in chunks:
                _chunk_seen(seen, chunk, time.monotonic())
                await asyncio.sleep(0)  # a whole response already read would otherwise end unseen
    except openai.APIError as e:
        seen.id = seen.id or getattr(e, "request_id", None) or ""  # an admitted request's id
        code = getattr(e, "code", None)
        seen.error_code = str(code) if code else None
        seen.error = seen.error_code or type(e).__name__
        seen.status = getattr(e, "status_code", None)
    except Exception as e:  # not an API error (a connection cut mid-stream, a body it cannot read)
        seen.error = type(e).__name__
    seen.ended_s = time.monotonic()
