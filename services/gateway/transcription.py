"""The transcription API's answers: a listener request's segments as one body in OpenAI's
``json``, ``text``, ``verbose_json``, ``srt`` or ``vtt`` format, or streamed as transcript events
(``transcript.text.delta`` per segment, then ``transcript.text.done``).

Whisper starts each segment's text with a space; the transcript is the segments' texts joined,
the first one's leading space dropped, so the streamed deltas add up to the done event's text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from libs.common.envelopes import ClientEvent, ClientEventType, Heard
from services.gateway.responses import Collected, Job, abort_reason, events_until_done, finish
from services.gateway.schemas import (
    DurationUsage,
    TokenUsage,
    TranscriptDelta,
    TranscriptDone,
    Transcription,
    TranscriptionSegment,
    TranscriptionVerbose,
)

AUDIO_TOKENS_PER_S = 50
"""Whisper's encoder positions per second of audio (1,500 per 30 s window): a streamed
transcription's ``input_tokens``."""


@dataclass
class Transcript:
    """What a listener request produced: its segments' events and its ``text_done``."""

    segments: list[ClientEvent] = field(default_factory=list)
    done: ClientEvent | None = None

    def add(self, ev: ClientEvent) -> None:
        if ev.type == ClientEventType.TEXT:
            self.segments.append(ev)
        elif ev.type == ClientEventType.TEXT_DONE:
            self.done = ev

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments).lstrip()

    @property
    def heard(self) -> Heard:
        return self.done.heard if self.done is not None and self.done.heard is not None else Heard()


async def transcript_of(job: Job) -> Transcript:
    """The request's whole transcript (its failure raised as :class:`APIError`)."""
    out = Transcript()
    async for ev in events_until_done(job):
        out.add(ev)
    return out


async def transcript_once(job: Job) -> Transcript:
    """The transcript of a transcription the gateway asked for itself (a chat's audio part): the
    request released when it ends, aborted in every stage when it fails; recorded either way."""
    try:
        t = await transcript_of(job)
    except BaseException as e:
        job.client.abort(job.id, abort_reason(e))
        finish(job, time.monotonic())
        raise
    job.client.release(job.id)
    finish(job, time.monotonic())
    return t


def transcription_body(t: Transcript, response_format: str, temperature: float) -> Response:
    """One response in ``response_format``."""
    heard = t.heard
    usage = DurationUsage(seconds=round(heard.end_s, 3))
    if response_format == "text":
        return PlainTextResponse(t.text + "\n")
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(_subtitles(t, response_format))
    if response_format == "verbose_json":
        body = TranscriptionVerbose(
            language=LANGUAGES.get(heard.language, heard.language),
            duration=round(heard.end_s, 3),
            text=t.text,
            segments=[_segment(i, ev, temperature) for i, ev in enumerate(t.segments)],
            usage=usage,
        )
        return JSONResponse(body.model_dump())
    return JSONResponse(Transcription(text=t.text, usage=usage).model_dump())


def _segment(i: int, ev: ClientEvent, temperature: float) -> TranscriptionSegment:
    h = ev.heard or Heard()
    return TranscriptionSegment(
        id=i,
        seek=int(h.start_s * 100),  # Whisper's seek unit: 10 ms frames
        start=round(h.start_s, 3),
        end=round(h.end_s, 3),
        text=ev.text,
        tokens=ev.token_ids,
        temperature=temperature,
        avg_logprob=h.avg_logprob,
        compression_ratio=h.compression_ratio,
        no_speech_prob=h.no_speech_prob,
    )


def _subtitles(t: Transcript, kind: str) -> str:
    """SubRip (``srt``) or WebVTT (``vtt``) cues, one per segment."""
    sep = "," if kind == "srt" else "."
    cues = []
    for i, ev in enumerate(t.segments, 1):
        h = ev.heard or Heard()
        times = f"{_clock(h.start_s, sep)} --> {_clock(h.end_s, sep)}"
        cues.append(
            f"{i}\n{times}\n{ev.text.strip()}\n" if kind == "srt" else f"{times}\n{ev.text.strip()}\n"
        )
    return ("WEBVTT\n\n" if kind == "vtt" else "") + "\n".join(cues)


def _clock(s: float, sep: str) -> str:
    ms = round(s * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


class TranscriptEvents:
    """The render and tail functions of a streamed transcription (for ``sse_stream``)."""

    def __init__(self, audio_s: float) -> None:
        self._audio_tokens = round(audio_s * AUDIO_TOKENS_PER_S)
        self._text: list[str] = []

    def render(self, ev: ClientEvent) -> list[str]:
        if ev.type != ClientEventType.TEXT:
            return []
        delta = ev.text if self._text else ev.text.lstrip()
        self._text.append(delta)
        return [TranscriptDelta(delta=delta).model_dump_json()]

    def tail(self, c: Collected) -> list[str]:
        out = c.usage.completion_tokens if c.usage is not None else 0
        usage = TokenUsage(
            input_tokens=self._audio_tokens, output_tokens=out, total_tokens=self._audio_tokens + out
        )
        return [TranscriptDone(text="".join(self._text), usage=usage).model_dump_json()]
