"""``omnirelay bench-speech``: time to first audio and real-time factor of a speech pipeline.

One ``omnirelay up`` stack of the pipeline (default ``compose/pipelines/orpheus-tiny.yaml``:
tiny thinker → Orpheus talker on tiny-orpheus → SNAC on tiny-snac) with its own NATS, driven as a
user drives it: the official ``openai`` client, streamed chat completions with
``modalities=["text", "audio"]`` and ``audio={"voice": ..., "format": "pcm16"}``. At each
concurrency level, ``requests`` requests run with at most ``concurrency`` in flight.

Per request, measured client-side with ``time.perf_counter()`` (seconds):

- TTFP: arrival of the first chunk carrying audio data minus send;
- audio: the PCM16 samples received ÷ the codec's sample rate (seconds of audio);
- RTF: (arrival of the last chunk carrying audio data − send) ÷ audio seconds (below 1: the
  audio arrived faster than it plays).

A request also fails when its audio is not a whole number of codec frames (SNAC: 2,048 samples).
Per level: p50 and p99 of TTFP and RTF over the successful requests (:func:`summarize`, a pure
function tested in ``tests/unit/test_speech_latency.py``), failures counted apart.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import (
    PROMPTS,
    Processes,
    closed_loop,
    log,
    machine_activity,
    percentile,
    run_with_stacks,
    start_stack,
)
from libs.common.pipeline import PipelineConfig, load_pipeline

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PIPELINE = ROOT / "compose" / "pipelines" / "orpheus-tiny.yaml"
PCM16_BYTES = 2
"""Bytes per PCM16 sample."""


@dataclass(frozen=True)
class SpeechTiming:
    """One streamed speech request as the client saw it: ``time.perf_counter()`` readings, seconds."""

    sent_s: float
    done_s: float
    first_audio_s: float | None
    """Arrival of the first chunk carrying audio data."""
    last_audio_s: float | None
    """Arrival of the last chunk carrying audio data."""
    samples: int
    """PCM16 samples received."""
    sample_rate: int
    """Hz."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_audio_s is not None and self.samples > 0

    @property
    def audio_s(self) -> float:
        """Seconds of audio received."""
        return self.samples / self.sample_rate

    @property
    def ttfp_s(self) -> float | None:
        """Time to first audio packet, seconds from send (None for a failed request)."""
        return self.first_audio_s - self.sent_s if self.ok else None

    @property
    def rtf(self) -> float | None:
        """(last audio arrival − send) ÷ audio seconds (None for a failed request)."""
        if not self.ok or self.last_audio_s is None:
            return None
        return (self.last_audio_s - self.sent_s) / self.audio_s


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level: percentiles over its successful requests."""

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


def summarize(concurrency: int, timings: Sequence[SpeechTiming], wall_s: float) -> LevelResult:
    """p50/p99 of TTFP and RTF over the successful ``timings`` (percentiles interpolated between
    ranks, :func:`benchmarks.harness.percentile`). Raises ValueError when none succeeded."""
    ok = [t for t in timings if t.ok]
    if not ok:
        errors = [t.error for t in timings if t.error]
        raise ValueError(f"c={concurrency}: no request succeeded ({errors[0] if errors else 'no audio'})")
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
    )


def render(results: Sequence[LevelResult]) -> str:
    """Markdown table of the levels (TTFP in ms)."""
    lines = [
        "| concurrency | requests | failed | TTFP p50, ms | TTFP p99, ms | RTF p50 | RTF p99 "
        "| audio per request, s | level wall, s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.concurrency} | {r.requests} | {r.failed} | {r.ttfp_p50_s * 1e3:.0f} "
            f"| {r.ttfp_p99_s * 1e3:.0f} | {r.rtf_p50:.3f} | {r.rtf_p99:.3f} | {r.audio_mean_s:.2f} "
            f"| {r.wall_s:.1f} |"
        )
    lines += [f"c={r.concurrency}: first failure: {r.first_error}" for r in results if r.first_error]
    return "\n".join(lines)


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
    return SpeechTiming(sent, done, first, last, samples, sample_rate, error)


async def run_level(
    client,
    model: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    voice: str,
    geometry: tuple[int, int],
) -> tuple[float, list[SpeechTiming]]:
    """``requests`` requests with at most ``concurrency`` in flight; (wall seconds, timings)."""
    return await closed_loop(
        requests,
        concurrency,
        lambda i: speech_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, voice, *geometry),
    )


def _commit() -> str:
    """This checkout's commit (short hash, ``+dirty`` with uncommitted changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return (
        head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        if head.returncode == 0
        else "unknown"
    )


async def _measure(
    base_url: str,
    pipeline: PipelineConfig,
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    voice: str,
    warmup: int,
) -> list[LevelResult]:
    from openai import AsyncOpenAI

    geometry = codec_geometry(pipeline)
    model = pipeline.served_model_name
    client = AsyncOpenAI(base_url=base_url, api_key="bench", timeout=300.0, max_retries=0)
    try:
        if warmup:
            _, timings = await run_level(client, model, 1, warmup, max_tokens, voice, geometry)
            if not any(t.ok for t in timings):
                raise RuntimeError(f"warm-up failed: {timings[0].error}")
        results = []
        for c in levels:
            wall, timings = await run_level(client, model, c, requests, max_tokens, voice, geometry)
            results.append(summarize(c, timings, wall))
            log(
                f"c={c}: {len(timings)} requests in {wall:.1f} s, TTFP p50 {results[-1].ttfp_p50_s * 1e3:.0f} ms"
            )
        return results
    finally:
        await client.close()


def run_speech_bench(
    pipeline_path: Path,
    levels: Sequence[int],
    requests: int,
    max_tokens: int,
    voice: str,
    warmup: int,
    keep_logs: bool = False,
) -> int:
    """Start the stack, measure every level, print the table; 0, or 1 when a level failed entirely."""
    pipeline = load_pipeline(pipeline_path)

    def work(procs: Processes, data_dir: Path) -> None:
        stack = start_stack(procs, "speech", pipeline_path, {}, data_dir)
        log(f"machine before: {machine_activity()}")
        try:
            results = asyncio.run(
                _measure(stack.base_url, pipeline, levels, requests, max_tokens, voice, warmup)
            )
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        log(f"machine after: {machine_activity()}")
        print(
            f"{pipeline.name}, voice {voice}, pcm16 streamed, {max_tokens} thinker tokens per request; "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}, commit {_commit()}, {len(os.sched_getaffinity(0))} cores",
            flush=True,
        )
        print(render(results), flush=True)

    return run_with_stacks("omnirelay-bench-speech-", work, keep=keep_logs)
