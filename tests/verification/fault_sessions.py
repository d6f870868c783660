"""The fault suite's realtime sessions (the ``speech`` pipeline's rows): a caller speaks one turn
of real speech (espeak-ng) into ``/v1/realtime`` through the official ``openai`` client, paced in
real time with server VAD, hears the spoken answer, then asks one short text turn to show that the
session goes on. What the client saw goes into a :class:`benchmarks.chat_streams.Seen`:

- ``heard``: the caller's turn as the listener transcribed it (greedy Whisper: the fault-free run's
  transcript is the reference, so a segment heard twice or lost shows);
- ``at``, ``audio_bytes``, ``text``: the spoken answer's audio deltas and transcript;
- ``usage_tokens``: the answer's ``output_tokens`` (the thinker's tokens; the tiny talker speaks
  each one as :data:`SAMPLES_PER_TOKEN` samples, so the audio's length proves each was spoken once).

Clocks: ``time.monotonic()`` of this process, seconds.
"""

from __future__ import annotations

import asyncio
import base64
import time

from benchmarks.realtime_latency import speak, spoken_pcm

SAMPLES_PER_TOKEN = 4 * 480
"""24 kHz samples the tiny talker and code2wav make of one thinker token (4 codes of 480)."""
PASSAGE = (
    "The harbour was quiet before dawn. Fishing boats rocked on the grey water, and the gulls "
    "waited on the wall. An old man walked along the pier with a lantern in his hand. He stopped "
    "at the last boat and looked out to sea."
)
"""The caller's turn: about 12 s of speech, so two listener replicas are busy with four sessions'
turns for seconds (the listener rows strike then)."""
SILENCE_MS = 1200
"""Server VAD's silence before a turn ends: longer than espeak-ng's pauses between sentences, so
the passage is one turn."""
FOLLOW_UP_TOKENS = 16
"""The text turn after the spoken one: short, it only has to be answered whole."""
TURN_TIMEOUT_S = 150.0


def caller_speech() -> bytes:
    """The caller's turn: 24 kHz mono PCM16 of :data:`PASSAGE`, silence around it."""
    return spoken_pcm(PASSAGE, before_s=0.3, after_s=SILENCE_MS / 1000 + 0.5)


async def _answer(conn, seen, spoken: bool) -> str:
    """Read events until ``response.done``; a spoken answer's events go into ``seen``. Returns the
    response's status (an ``error`` event: ``error <code>``)."""
    while True:
        event = await conn.recv()
        now = time.monotonic()
        if event.type == "conversation.item.input_audio_transcription.completed":
            seen.heard += event.transcript
        elif event.type == "response.created" and spoken:
            seen.id = event.response.id or ""
        elif event.type == "response.output_audio.delta" and spoken:
            seen.at.append(now)
            seen.audio_bytes += len(base64.b64decode(event.delta))
            seen.audio_chunks += 1
        elif event.type == "response.output_audio_transcript.delta" and spoken:
            seen.text += event.delta
        elif event.type == "error":
            return f"error {event.error.code}"
        elif event.type == "response.done":
            if spoken and event.response.usage is not None:
                seen.usage_tokens = event.response.usage.output_tokens
            return event.response.status or ""


async def send_session(base_url: str, model: str, seen, pcm: bytes, max_tokens: int) -> None:
    """One session: the spoken turn ``pcm`` answered in at most ``max_tokens``, then a text turn.
    A failure (a status other than ``completed``, an ``error`` event, a dropped socket, no end
    within :data:`TURN_TIMEOUT_S`) is recorded in ``seen``, never raised."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    seen.sent_s = time.monotonic()
    try:
        async with asyncio.timeout(TURN_TIMEOUT_S), client.realtime.connect(model=model) as conn:
            vad = {"type": "server_vad", "silence_duration_ms": SILENCE_MS}
            session = {"type": "realtime", "max_output_tokens": max_tokens}
            await conn.session.update(session={**session, "audio": {"input": {"turn_detection": vad}}})
            speaking = asyncio.create_task(speak(conn, pcm))
            status = await _answer(conn, seen, spoken=True)
            await speaking
            if status == "completed":
                await conn.conversation.item.create(
                    item={
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Go on."}],
                    }
                )
                await conn.response.create(response={"max_output_tokens": FOLLOW_UP_TOKENS})
                status = await _answer(conn, seen, spoken=False)
                status = status if status == "completed" else f"follow-up {status}"
            if status != "completed":
                seen.error = status
    except TimeoutError:
        pass  # not ended: the row counts it hung
    except Exception as e:  # a socket the server closed, a connection refused
        seen.error = type(e).__name__
    else:
        seen.ended_s = time.monotonic()
    if seen.error is not None and seen.ended_s is None:
        seen.ended_s = time.monotonic()
    await client.close()
