"""``/v1/audio/speech/stream``: text streamed into speech over a WebSocket, with vLLM-Omni's message
names, so its clients work unchanged.

The client sends ``session.config`` first (``voice``, ``response_format``: ``pcm`` by default,
``speed``), then the text as it is written (``input.text``: an LLM's tokens, say) and ``input.done``.
The gateway cuts the text as a thinker's output is cut for the talker (:mod:`libs.common.text_chunks`:
every ``chunking.tokens`` tokens of the thinker's tokenizer, or earlier at a sentence's end, whole
words only until ``input.done``) and each chunk becomes a speech request at once, so the talker
starts on it while the client is still writing. The chunks' audio goes back in order: per chunk
``audio.start`` (``sentence_index``, ``sentence_text``, ``format``), binary frames of the audio in the
asked format, ``audio.done``; at the end ``session.done`` (``total_sentences``). A bad message is an
``error`` event and the socket lives on; a chunk whose request fails is an ``error`` event naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any, Literal

from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libs.common.envelopes import ClientEventType, SpeechChunk
from libs.common.playback import AudioChunk
from libs.common.text_chunks import TextChunk, TextChunker
from services.gateway.audio import AudioFormat
from services.gateway.audio_tempo import MAX_SPEED, MIN_SPEED
from services.gateway.errors import APIError, response_of
from services.gateway.realtime.route import ws_principal
from services.gateway.responses import Job, abort_reason, events_until_done, finish
from services.gateway.speech import SpeechEncoding
from services.gateway.submission import Arrival, Submitter

log = logging.getLogger(__name__)

MAX_TEXT_CHARS = 100_000
"""Text one session may stream, characters."""
_WORD = re.compile(r"\s*\S+")
"""A word with the white space before it: the unit the text is tokenized and cut in."""

router = APIRouter()


class StreamConfig(BaseModel):
    """``session.config``: how the session's speech sounds and travels."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["session.config"]
    voice: str | None = None
    response_format: AudioFormat = AudioFormat.PCM
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)


class StreamedText:
    """The text of one session cut into chunks as it comes (whole words until the end)."""

    def __init__(self, submitter: Submitter) -> None:
        self._tokenizer = submitter.tokenizer
        chunking = submitter.pipeline.thinker.chunking
        self._chunker = TextChunker(chunking.tokens, chunking.sentence_end)
        self._pending = ""
        self.total = 0

    def feed(self, text: str, done: bool = False) -> list[TextChunk]:
        """The chunks ``text`` completes (and with ``done`` whatever is left)."""
        self.total += len(text)
        if self.total > MAX_TEXT_CHARS:
            raise APIError(400, f"a session streams at most {MAX_TEXT_CHARS} characters", "input_too_long")
        self._pending += text
        words = _WORD.findall(self._pending)
        if not done and words and not self._pending[-1:].isspace():
            words = words[:-1]  # the last word may go on in the next piece
        self._pending = self._pending[sum(map(len, words)) :]
        out = []
        for word in words:
            out += self._chunker.feed(self._tokenizer.words(word), word)
        if done:
            out.append(self._chunker.flush())
        return [c for c in out if c.token_ids]


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(ws: WebSocket) -> None:
    try:
        principal = ws_principal(ws)
        ws.app.state.realtime_sessions.acquire(principal)
    except APIError as e:
        await ws.send_denial_response(response_of(e))
        return
    try:
        await ws.accept()
        await _serve(ws, ws.app.state.submitter)
    finally:
        ws.app.state.realtime_sessions.release(principal)


async def _serve(ws: WebSocket, submitter: Submitter) -> None:
    """Read the session's messages; speak each chunk as it is cut, in order."""
    jobs: asyncio.Queue[tuple[TextChunk, Job] | None] = asyncio.Queue()
    config: StreamConfig | None = None
    text = StreamedText(submitter)
    speaking: asyncio.Task[None] | None = None
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                event = _event(message)
                if config is None:
                    candidate = StreamConfig.model_validate(event)
                    submitter.voice(candidate.voice)  # an unknown voice is refused now, not per chunk
                    config = candidate
                    speaking = asyncio.create_task(_speak(ws, jobs, config))
                    continue
                done = event.get("type") == "input.done"
                if not done and event.get("type") != "input.text":
                    raise APIError(400, f"unknown message type {event.get('type')!r}", "invalid_event_type")
                for chunk in text.feed(str(event.get("text", "")), done):
                    jobs.put_nowait((chunk, await _submit(submitter, chunk, config)))
                if done:
                    jobs.put_nowait(None)
                    await speaking
                    await ws.close()
                    return
            except (ValidationError, APIError) as e:
                await ws.send_text(json.dumps(_error(e)))
    finally:
        if speaking is not None and not speaking.done():
            speaking.cancel()
        while not jobs.empty():
            if (item := jobs.get_nowait()) is not None:
                item[1].client.abort(item[1].id, "client disconnected")


def _event(message: dict[str, Any]) -> dict[str, Any]:
    try:
        event = json.loads(message.get("text") or message.get("bytes") or "")
    except ValueError:
        raise APIError(400, "a message must be a JSON object", "invalid_json") from None
    if not isinstance(event, dict):
        raise APIError(400, "a message must be a JSON object", "invalid_json")
    return event


async def _submit(submitter: Submitter, chunk: TextChunk, config: StreamConfig) -> Job:
    spoken = SpeechChunk(text=chunk.text.strip(), token_ids=chunk.token_ids)
    arrival = Arrival(time.time_ns(), time.monotonic())
    voice = submitter.voice(config.voice)
    model = submitter.pipeline.served_model_name
    return await submitter.speak([spoken], voice, model, config.response_format.value, arrival)


async def _speak(
    ws: WebSocket, jobs: asyncio.Queue[tuple[TextChunk, Job] | None], config: StreamConfig
) -> None:
    """Send each chunk's audio, in order, then ``session.done``."""
    index = 0
    while (item := await jobs.get()) is not None:
        chunk, job = item
        fmt = config.response_format.value
        await ws.send_text(
            json.dumps(
                {
                    "type": "audio.start",
                    "sentence_index": index,
                    "sentence_text": chunk.text.strip(),
                    "format": fmt,
                }
            )
        )
        try:
            await _audio(ws, job, SpeechEncoding(fmt, config.speed))
            await ws.send_text(json.dumps({"type": "audio.done", "sentence_index": index}))
        except APIError as e:
            job.client.abort(job.id, abort_reason(e))
            await ws.send_text(json.dumps({**_error(e), "sentence_index": index}))
        finally:
            finish(job, time.monotonic())
        index += 1
    await ws.send_text(json.dumps({"type": "session.done", "total_sentences": index}))


async def _audio(ws: WebSocket, job: Job, enc: SpeechEncoding) -> None:
    """One chunk's audio as binary frames, encoded as they come."""
    rate = 0
    async for ev in events_until_done(job):
        if ev.type == ClientEventType.AUDIO:
            rate, before = ev.sample_rate or rate, enc.played_bytes
            out = enc.push(ev.pcm16, ev.sample_rate)
            job.stats.audio_chunks.append(AudioChunk(time.monotonic(), enc.played_bytes - before))
            if out:
                await ws.send_bytes(out)
        elif ev.type == ClientEventType.AUDIO_DONE:
            rate = ev.sample_rate or rate
    if tail := enc.close(rate):
        await ws.send_bytes(tail)
    job.client.release(job.id)


def _error(e: ValidationError | APIError) -> dict[str, Any]:
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return {
            "type": "error",
            "code": "invalid_value",
            "param": where,
            "message": f"{where}: {first['msg']}",
        }
    return {"type": "error", "code": e.code, "param": e.param, "message": e.message}
