"""``omnirelay bench speech``: time to first audio and real-time factor of a speech pipeline.

One ``omnirelay up`` stack of the pipeline (default ``compose/pipelines/orpheus-tiny.yaml``) driven
through the official ``openai`` client by one of two APIs: ``chat``, streamed chat completions
with ``audio={"format": "pcm16"}``, at most ``concurrency`` in flight (a closed loop); or
``speech``, ``POST /v1/audio/speech`` streamed in each asked ``response_format``, the formats taking
turns in blocks of ``concurrency`` requests sent at once (:func:`speech_blocks`).

Per request, client-side ``time.perf_counter()`` seconds: TTFP (chat: first chunk with audio data)
or TTFB (speech: first body bytes) minus send; the audio's seconds (chat: PCM16 samples ÷ the
codec's rate; speech: the body decoded whole after the level, :func:`audio_seconds`); RTF = (last
audio chunk − send) ÷ audio seconds. A request fails when its PCM is not whole codec frames or its
body does not decode. Per level (:func:`summarize`, pure): p50 and p99 of TTFP and RTF over the
successful requests; for speech, also the gateway process's CPU over the level (where encoding runs).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import av

from benchmarks.frontend_capacity import stack_roles
from benchmarks.harness import (
    PROMPTS,
    ROOT,
    Processes,
    closed_loop,
    commit,
    log,
    percentile,
    run_with_stacks,
    start_stack,
)
from benchmarks.process_table import machine_activity, process_cpu_s
from libs.common.pipeline import PipelineConfig, load_pipeline

DEFAULT_PIPELINE = ROOT / "compose" / "pipelines" / "orpheus-tiny.yaml"
PCM16_BYTES = 2
"""Bytes per PCM16 sample."""
APIS = ("chat", "speech")
SPEECH_CONTAINERS = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}
"""Speech ``response_format`` → the FFmpeg demuxer its body must open with (``pcm`` has none)."""
SPEECH_FORMATS = (*SPEECH_CONTAINERS, "pcm")
DEFAULT_SPEECH_FORMATS = ("pcm", "mp3")
SPEECH_INPUTS = (
    "The lighthouse keeper climbed the stairs at dusk. Far below, the waves broke white on the rocks.",
    "A bicycle stays upright because its front wheel steers under it whenever it starts to lean.",
    "At night the sea is dark and calm. Only the lights of a distant ship move along the horizon.",
    "Pack warm layers, a rain jacket and good boots. The weather in the mountains changes quickly.",
)
"""Speech inputs; request i speaks ``SPEECH_INPUTS[i % len(SPEECH_INPUTS)]`` (the tiny talker's
cap, 0.5 frames per character, makes each about 4 s of audio)."""


@dataclass(frozen=True)
class SpeechTiming:
    """One streamed request as the client saw it: ``time.perf_counter()`` readings, seconds."""

    sent_s: float
    done_s: float
    first_audio_s: float | None
    """Arrival of the first chunk carrying audio (chat: audio data; speech: body bytes)."""
    last_audio_s: float | None
    """Arrival of the last chunk carrying audio."""
    audio_s: float
    """Seconds of audio received."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_audio_s is not None and self.audio_s > 0

    @property
    def ttfp_s(self) -> float | None:
        """Time to first audio, seconds from send (None for a failed request)."""
        return self.first_audio_s - self.sent_s if self.ok else None

    @property
    def rtf(self) -> float | None:
        """(last audio arrival − send) ÷ audio seconds (None for a failed request)."""
        if not self.ok or self.last_audio_s is None:
            return None
        return (self.last_audio_s - self.sent_s) / self.audio_s


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level (of one speech format): percentiles over its successful requests."""

    concurrency: int
    requests: int
    failed: int
    ttfp_p50_s: float
    ttfp_p99_s: float
    rtf_p50: float
    rtf_p99: float
    audio_mean_s: float
    """Mean seconds of audio per successful request."""
    wall_s: float
    """Wall time of the level, seconds."""
    first_error: str | None = None
    format: str | None = None
    """The speech ``response_format`` (None: chat completions)."""
    gateway_cpu_pct: float | None = None
    """The gateway process's CPU over the level, percent of one core (speech only)."""


def summarize(
    concurrency: int, timings: Sequence[SpeechTiming], wall_s: float, fmt: str | None = None
) -> LevelResult:
    """p50/p99 of TTFP and RTF over the successful ``timings`` (percentiles interpolated between
    ranks, :func:`benchmarks.harness.percentile`) of one level, of speech format ``fmt`` (None:
    chat). Raises ValueError when none succeeded."""
    name = f"c={concurrency}" + (f" {fmt}" if fmt else "")
    ok = [t for t in timings if t.ok]
    if not ok:
        errors = [t.error for t in timings if t.error]
        raise ValueError(f"{name}: no request succeeded ({errors[0] if errors else 'no audio'})")
    ttfp = [t.ttfp_s for t in ok]
    rtf = [t.rtf for t in ok]
    failed = [t for t in timings if not t.ok]
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        failed=len(failed),
        ttfp_p50_s=percentile(ttfp, 50),
        ttfp_p99_s=percentile(ttfp, 99),
        rtf_p50=percentile(rtf, 50),
        rtf_p99=percentile(rtf, 99),
        audio_mean_s=sum(t.audio_s for t in ok) / len(ok),
        wall_s=wall_s,
        first_error=next((t.error or "no audio" for t in failed), None),
        format=fmt,
    )


def render(results: Sequence[LevelResult]) -> str:
    """Markdown table of the levels (TTFP/TTFB in ms). Speech results (with a format) get a
    ``format`` column after the concurrency and the gateway's CPU at the end; chat's table is
    the levels alone."""
    speech = any(r.format for r in results)
    first = "TTFB" if speech else "TTFP"
    head = ["concurrency", *(["format"] if speech else []), "requests", "failed"]
    head += [f"{first} p50, ms", f"{first} p99, ms", "RTF p50", "RTF p99", "audio per request, s"]
    head += ["level wall, s", *(["gateway CPU, % of a core"] if speech else [])]
    lines = [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---:" if h != "format" else "---" for h in head) + " |",
    ]
    for r in results:
        cells = [str(r.concurrency), *([r.format or ""] if speech else []), str(r.requests), str(r.failed)]
        cells += [f"{r.ttfp_p50_s * 1e3:.0f}", f"{r.ttfp_p99_s * 1e3:.0f}", f"{r.rtf_p50:.3f}"]
        cells += [f"{r.rtf_p99:.3f}", f"{r.audio_mean_s:.2f}", f"{r.wall_s:.1f}"]
        if speech:
            cells.append("" if r.gateway_cpu_pct is None else f"{r.gateway_cpu_pct:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        f"c={r.concurrency}{' ' + r.format if r.format else ''}: first failure: {r.first_error}"
        for r in results
        if r.first_error
    ]
    return "\n".join(lines)


def audio_seconds(fmt: str, body: bytes, sample_rate: int) -> float:
    """Seconds of audio in a speech response's ``body`` of format ``fmt``: ``pcm`` is headerless
    PCM16 mono at ``sample_rate`` Hz (bytes ÷ 2 ÷ rate); a container is opened with its own
    demuxer (an mp3 body must be mp3) and decoded whole by PyAV: decoded samples ÷ their rate
    (Opus decodes at 48,000 Hz). A streamed mp3 or AAC decodes up to ~0.06 s longer than its
    input (encoder priming a stream cannot signal, docs/audio.md). Raises ValueError when the
    body does not decode or holds no audio."""
    if fmt == "pcm":
        if len(body) % PCM16_BYTES:
            raise ValueError(f"pcm body of {len(body)} bytes is not whole 16-bit samples")
        seconds = len(body) / PCM16_BYTES / sample_rate
    else:
        try:
            with av.open(io.BytesIO(body), format=SPEECH_CONTAINERS[fmt]) as container:
                if not container.streams.audio:
                    raise ValueError(f"{fmt} body of {len(body)} bytes has no audio stream")
                stream = container.streams.audio[0]
                seconds = sum(f.samples / f.sample_rate for f in container.decode(stream))
        except av.FFmpegError as e:
            raise ValueError(f"{fmt} body of {len(body)} bytes does not decode: {e}") from None
    if seconds <= 0:
        raise ValueError(f"{fmt} body of {len(body)} bytes holds no audio")
    return seconds


def parse_formats(text: str) -> tuple[str, ...]:
    """Comma-separated speech formats (``"pcm, mp3"``) in their order; ValueError for an empty,
    unknown or repeated one."""
    formats = tuple(f.strip() for f in text.split(","))
    for f in formats:
        if f not in SPEECH_FORMATS:
            raise ValueError(f"{f!r} is not one of {', '.join(SPEECH_FORMATS)}")
    if len(set(formats)) != len(formats):
        raise ValueError(f"{text!r} names a format twice")
    return formats


def codec_geometry(pipeline: PipelineConfig) -> tuple[int, int]:
    """(sample rate in Hz, samples per frame) of the pipeline's audio stage, from its codec."""
    from libs.models.tiny import resolve_model
    from services.stage_worker.codecs import load_codec_adapter

    if pipeline.audio_stage is None:
        raise ValueError(f"pipeline '{pipeline.name}' produces no audio")
    adapter = load_codec_adapter(resolve_model(pipeline.stages[pipeline.audio_stage].model))
    return adapter.sample_rate, adapter.samples_per_frame


async def speech_request(
    client, model: str, prompt: str, max_tokens: int, voice: str, sample_rate: int, frame: int
) -> SpeechTiming:
    """One streamed chat completion with audio (pcm16) through ``client`` (an ``openai.AsyncOpenAI``),
    timed; a failure is recorded, never raised. ``frame``: samples per codec frame."""
    first = last = None
    pcm = 0
    error = None
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            modalities=["text", "audio"],
            audio={"voice": voice, "format": "pcm16"},
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            audio = chunk.choices[0].delta.audio if chunk.choices else None
            if audio is not None and audio.data:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                pcm += len(base64.b64decode(audio.data, validate=True))
    except Exception as e:  # a failed request is counted, never fatal
        error = f"{type(e).__name__}: {e}"[:300]
    done = time.perf_counter()
    samples = pcm // PCM16_BYTES
    if error is None and (pcm % PCM16_BYTES or samples % frame):
        error = f"{pcm} bytes of PCM16 are not whole frames of {frame} samples"
    return SpeechTiming(sent, done, first, last, samples / sample_rate, error)


@dataclass(frozen=True)
class SpeechBody:
    """A speech response as received: its timing (``audio_s`` still 0) and the body's bytes."""

    timing: SpeechTiming
    body: bytes


async def speech_api_request(client, model: str, text: str, voice: str, fmt: str) -> SpeechBody:
    """One ``POST /v1/audio/speech`` of ``text`` in ``fmt`` through ``client`` (an
    ``openai.AsyncOpenAI``), its body streamed and timed chunk by chunk; nothing is decoded here
    (:func:`with_audio` does, after the level). A failure is recorded, never raised."""
    first = last = None
    body = bytearray()
    error = None
    sent = time.perf_counter()
    try:
        async with client.audio.speech.with_streaming_response.create(
            model=model, voice=voice, input=text, response_format=fmt
        ) as response:
            async for chunk in response.iter_bytes():
                if chunk:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    body += chunk
    except Exception as e:  # a failed request is counted, never fatal
        error = f"{type(e).__name__}: {e}"[:300]
    return SpeechBody(SpeechTiming(sent, time.perf_counter(), first, last, 0.0, error), bytes(body))


def with_audio(fmt: str, got: SpeechBody, sample_rate: int, frame: int) -> SpeechTiming:
    """``got``'s timing with the seconds of audio its body decodes to (:func:`audio_seconds`);
    a body that does not decode, or ``pcm`` that is not whole frames of ``frame`` samples, fails
    the request."""
    if got.timing.error is not None or got.timing.first_audio_s is None:
        return got.timing
    try:
        seconds = audio_seconds(fmt, got.body, sample_rate)
    except ValueError as e:
        return replace(got.timing, error=str(e))
    error = None
    if fmt == "pcm" and (len(got.body) // PCM16_BYTES) % frame:
        error = f"{len(got.body)} bytes of pcm are not whole frames of {frame} samples"
    return replace(got.timing, audio_s=seconds, error=error)


def speech_blocks(requests: int, concurrency: int, formats: Sequence[str]) -> list[tuple[str, int, int]]:
    """The blocks of one speech level in the order they run: (format, first input index,
    requests), ``concurrency`` requests each (the last of a format fewer), the formats taking
    turns, so each format gets ``requests`` requests on inputs 0 … ``requests`` − 1."""
    return [
        (fmt, first, min(concurrency, requests - first))
        for first in range(0, requests, concurrency)
        for fmt in formats
    ]


async def run_speech_block(
    client, model: str, requests: int, first: int, voice: str, fmt: str
) -> tuple[float, list[SpeechBody]]:
    """``requests`` speech requests in ``fmt``, all sent at once, request i speaking input
    ``first + i`` (the inputs in turn); (wall seconds, responses as received)."""
    return await closed_loop(
        requests,
        requests,
        lambda i: speech_api_request(
            client, model, SPEECH_INPUTS[(first + i) % len(SPEECH_INPUTS)], voice, fmt
        ),
    )


async def _measure_chat(
    client,
    pipeline: PipelineConfig,
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    voice: str,
    warmup: int,
) -> list[LevelResult]:
    """Every level: ``requests`` chat requests, at most ``concurrency`` in flight."""
    geometry = codec_geometry(pipeline)
    model = pipeline.served_model_name

    def level(c: int, n: int) -> Awaitable[tuple[float, list[SpeechTiming]]]:
        def one(i: int) -> Awaitable[SpeechTiming]:
            return speech_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, voice, *geometry)

        return closed_loop(n, c, one)

    if warmup:
        _, timings = await level(1, warmup)
        if not any(t.ok for t in timings):
            raise RuntimeError(f"warm-up failed: {timings[0].error}")
    results = []
    for c in levels:
        wall, timings = await level(c, requests)
        results.append(summarize(c, timings, wall))
        log(f"c={c}: {len(timings)} requests in {wall:.1f} s, TTFP p50 {results[-1].ttfp_p50_s * 1e3:.0f} ms")
    return results


async def _measure_speech(
    client,
    pipeline: PipelineConfig,
    levels: Sequence[int],
    requests: int,
    voice: str,
    warmup: int,
    formats: Sequence[str],
    gateway_cpu_s: Callable[[], float],
) -> list[LevelResult]:
    """Every level for every format. Within a level the formats take turns in blocks of
    ``concurrency`` requests sent at once (pcm's block, mp3's, ..., pcm's next), so they share
    the machine's drift; a format's wall time and gateway CPU are the sums over its blocks. The
    bodies are decoded after the level, outside every timed window."""
    geometry = codec_geometry(pipeline)
    model = pipeline.served_model_name
    for fmt in formats:
        warm = [(await run_speech_block(client, model, 1, i, voice, fmt))[1][0] for i in range(warmup)]
        timings = [with_audio(fmt, w, *geometry) for w in warm]
        if timings and not any(t.ok for t in timings):
            raise RuntimeError(f"{fmt} warm-up failed: {timings[0].error}")
    results = []
    for c in levels:
        wall = dict.fromkeys(formats, 0.0)
        cpu_s = dict.fromkeys(formats, 0.0)
        got: dict[str, list[SpeechBody]] = {fmt: [] for fmt in formats}
        for fmt, first, n in speech_blocks(requests, c, formats):
            cpu_before = gateway_cpu_s()
            block_wall, block = await run_speech_block(client, model, n, first, voice, fmt)
            cpu_s[fmt] += gateway_cpu_s() - cpu_before
            wall[fmt] += block_wall
            got[fmt] += block
        for fmt in formats:
            timings = [with_audio(fmt, g, *geometry) for g in got[fmt]]
            result = summarize(c, timings, wall[fmt], fmt)
            results.append(replace(result, gateway_cpu_pct=cpu_s[fmt] / wall[fmt] * 100))
            ttfb_ms = sorted(round(t.ttfp_s * 1e3) for t in timings if t.ok)
            log(f"c={c} {fmt}: {wall[fmt]:.1f} s, gateway CPU {cpu_s[fmt]:.2f} s, TTFB ms {ttfb_ms}")
    return results


def run_speech_bench(
    pipeline_path: Path,
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    voice: str,
    warmup: int,
    keep_logs: bool = False,
    formats: Sequence[str] = (),
) -> int:
    """Start the stack, measure every level (chat completions, or with ``formats`` the speech
    API in each of them), print the table; 0, or 1 when a level failed entirely."""
    from openai import AsyncOpenAI

    pipeline = load_pipeline(pipeline_path)

    async def measure(base_url: str, gateway_cpu_s: Callable[[], float]) -> list[LevelResult]:
        async with AsyncOpenAI(base_url=base_url, api_key="bench", timeout=300.0, max_retries=0) as client:
            if formats:
                return await _measure_speech(
                    client, pipeline, levels, requests, voice, warmup, formats, gateway_cpu_s
                )
            return await _measure_chat(client, pipeline, levels, requests, max_tokens, voice, warmup)

    def work(procs: Processes, data_dir: Path) -> None:
        stack = start_stack(procs, "speech", pipeline_path, {}, data_dir)
        gateways = stack_roles(stack, None, []).get("gateway-1", [])
        if len(gateways) != 1:
            raise RuntimeError(f"{len(gateways)} gateway processes under omnirelay up, expected 1")
        gateway_cpu_s = functools.partial(process_cpu_s, gateways[0])
        before = machine_activity()
        log(f"machine before: {before}")
        try:
            results = asyncio.run(measure(stack.api_url, gateway_cpu_s))
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        after = machine_activity()
        log(f"machine after: {after}")
        what = (
            f"/v1/audio/speech streamed ({', '.join(formats)}), {len(SPEECH_INPUTS)} inputs in turn"
            if formats
            else f"pcm16 streamed, {max_tokens} thinker tokens per request"
        )
        print(
            f"{pipeline.name}, voice {voice}, {what}; {time.strftime('%Y-%m-%d %H:%M %Z')}, "
            f"commit {commit()}, {len(os.sched_getaffinity(0))} cores, load average (1 min) "
            f"{before['loadavg_1m']:.1f} before, {after['loadavg_1m']:.1f} after",
            flush=True,
        )
        print(render(results), flush=True)

    return run_with_stacks("omnirelay-bench-speech-", work, keep=keep_logs)
