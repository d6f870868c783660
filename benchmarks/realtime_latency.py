"""``omnirelay bench realtime``: voice-to-voice latency of realtime sessions and the listener's
real-time factor, at each number of concurrent sessions, through the official ``openai`` client.

Every session speaks turns of real speech (espeak-ng: silence, a question, silence) in 100 ms
appends paced in real time, as a caller's microphone sends them, with server VAD's default 500 ms of
silence. A turn's voice-to-voice latency is the client's: from sending the append that holds the end
of the speech (``input_audio_buffer.speech_stopped``'s ``audio_end_ms``) to receiving the answer's
first audio delta, so the VAD's silence wait, the listener, the thinker's first chunk, the talker
and code2wav are all in it. The listener's RTF comes from its ``vllm:omni_asr_rtf`` histogram
(quantiles from its buckets, as Prometheus's ``histogram_quantile`` computes them).
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import av
import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import Processes, log, percentile, run_with_stacks, start_stack
from benchmarks.process_table import machine_activity
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, load_pipeline

DEFAULT_PIPELINE = DEFAULT_PIPELINE_PATH
QUESTION = "What is the weather like in Paris today?"
APPEND_MS = 100
BYTES_PER_MS = 48
"""24 kHz PCM16: the session's default input format."""


def spoken_pcm(text: str, before_s: float = 0.3, after_s: float = 1.2) -> bytes:
    """24 kHz mono PCM16 of espeak-ng saying ``text`` with silence around it."""
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "q.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), text], check=True)
        with av.open(str(wav)) as c:
            resampler = av.AudioResampler(format="s16", layout="mono", rate=24_000)
            pcm = b"".join(p.to_ndarray().tobytes() for f in c.decode(audio=0) for p in resampler.resample(f))
    return bytes(int(before_s * 1000) * BYTES_PER_MS) + pcm + bytes(int(after_s * 1000) * BYTES_PER_MS)


@dataclass
class Turn:
    voice_to_voice_s: float | None = None
    status: str = ""


@dataclass
class Level:
    sessions: int
    turns: list[Turn] = field(default_factory=list)
    rtf: tuple[float, float] | None = None
    """The listener's RTF p50, p99 over the level's transcriptions."""

    @property
    def latencies(self) -> list[float]:
        return [t.voice_to_voice_s for t in self.turns if t.voice_to_voice_s is not None]


async def speak(conn, pcm: bytes, sent: list[tuple[float, float]] | None = None) -> None:
    """Append ``pcm`` in 100 ms pieces paced in real time, as a microphone sends them; ``sent``:
    noted there, (audio ms at each append's end, when it was sent: ``time.monotonic()``)."""
    step, start = APPEND_MS * BYTES_PER_MS, time.monotonic()
    for i in range(0, len(pcm), step):
        await asyncio.sleep(max(0.0, start + i / BYTES_PER_MS / 1000 - time.monotonic()))
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())
        if sent is not None:
            sent.append((min(i + step, len(pcm)) / BYTES_PER_MS, time.monotonic()))


async def _turn(conn, pcm: bytes, offset_ms: float) -> Turn:
    """Speak one turn and wait for its answer; ``offset_ms``: the session's audio clock at its start."""
    sent: list[tuple[float, float]] = []
    speaking = asyncio.create_task(speak(conn, pcm, sent))
    end_ms, first_audio = None, None
    try:
        async with asyncio.timeout(120):
            while True:
                event = await conn.recv()
                if event.type == "input_audio_buffer.speech_stopped":
                    end_ms = event.audio_end_ms - offset_ms
                elif event.type == "response.output_audio.delta" and first_audio is None:
                    first_audio = time.monotonic()
                elif event.type == "response.done":
                    status = event.response.status
                    break
                elif event.type == "error":
                    return Turn(status=f"error {event.error.code}")
        await speaking
    except TimeoutError:
        speaking.cancel()
        return Turn(status="timeout")
    if end_ms is None or first_audio is None:
        return Turn(status=status)
    ended = next((t for at, t in sent if at >= end_ms), sent[-1][1])
    return Turn(first_audio - ended, status)


async def _session(base_url: str, model: str, pcm: bytes, turns: int, max_tokens: int) -> list[Turn]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    out = []
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": max_tokens})
        for i in range(turns):
            out.append(await _turn(conn, pcm, i * len(pcm) / BYTES_PER_MS))
    await client.close()
    return out


async def measure(
    base_url: str,
    model: str,
    pcm: bytes,
    sessions: int,
    turns: int,
    max_tokens: int,
    listener_metrics: Sequence[str],
) -> Level:
    """One level: ``sessions`` sessions at once, each speaking ``turns`` turns of ``pcm``."""
    before = _rtf_buckets(listener_metrics)
    results = await asyncio.gather(
        *(_session(base_url, model, pcm, turns, max_tokens) for _ in range(sessions))
    )
    level = Level(sessions, [t for r in results for t in r])
    level.rtf = _quantiles(_rtf_buckets(listener_metrics), before)
    return level


def _rtf_buckets(urls: Sequence[str]) -> dict[float, float]:
    """The listeners' ``vllm:omni_asr_rtf`` cumulative bucket counts, summed (le → count)."""
    out: dict[float, float] = {}
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            for s in fam.samples:
                if s.name == "vllm:omni_asr_rtf_bucket":
                    le = float(s.labels["le"])
                    out[le] = out.get(le, 0.0) + s.value
    return out


def _quantiles(after: dict[float, float], before: dict[float, float]) -> tuple[float, float] | None:
    counts = sorted((le, n - before.get(le, 0.0)) for le, n in after.items())
    total = counts[-1][1] if counts else 0
    if not total:
        return None
    return _bucket_quantile(counts, 0.5 * total), _bucket_quantile(counts, 0.99 * total)


def _bucket_quantile(counts: list[tuple[float, float]], rank: float) -> float:
    """Linear interpolation inside the bucket that holds ``rank`` (Prometheus's rule)."""
    low, below = 0.0, 0.0
    for le, n in counts:
        if n >= rank:
            if le == float("inf"):
                return low
            return low + (le - low) * (rank - below) / max(n - below, 1e-9)
        low, below = le, n
    return low


def render(levels: Sequence[Level]) -> str:
    rows = [
        "| sessions | turns | answered | voice-to-voice p50 | p99 | listener RTF p50 | p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        lat = lv.latencies
        p50, p99 = (f"{percentile(lat, 50):.3f} s", f"{percentile(lat, 99):.3f} s") if lat else ("-", "-")
        rtf = (f"{lv.rtf[0]:.3f}", f"{lv.rtf[1]:.3f}") if lv.rtf else ("-", "-")
        rows.append(f"| {lv.sessions} | {len(lv.turns)} | {len(lat)} | {p50} | {p99} | {rtf[0]} | {rtf[1]} |")
    return "\n".join(rows)


def run_realtime_bench(
    pipeline_path: Path, levels: Sequence[int], turns: int, max_tokens: int, keep_logs: bool = False
) -> int:
    """Start the stack, measure every level, print the table; 0 on success."""
    pipeline = load_pipeline(pipeline_path)
    pcm = spoken_pcm(QUESTION)

    def work(procs: Processes, data_dir: Path) -> None:
        stack = start_stack(procs, "realtime", pipeline_path, {}, data_dir, up_args=["--log-stats"])
        from libs.stack.bus_state import snapshot

        snap = asyncio.run(snapshot(stack.nats_url, pipeline))
        listeners = [
            s["metrics_url"]
            for s in snap["services"]
            if s["service"] == "worker" and s["stage"] == pipeline.listener_stage
        ]
        before = machine_activity()
        results = [
            asyncio.run(
                measure(stack.api_url, pipeline.served_model_name, pcm, n, turns, max_tokens, listeners)
            )
            for n in levels
        ]
        after = machine_activity()
        print(
            f"{pipeline.name}: {turns} turn(s) per session of a {len(pcm) / BYTES_PER_MS / 1000:.1f} s question "
            f"(espeak-ng), sent in real time, answers of {max_tokens} thinker tokens; "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}, load average {before['loadavg_1m']:.1f} before, "
            f"{after['loadavg_1m']:.1f} after",
            flush=True,
        )
        print(render(results), flush=True)
        log("done")

    return run_with_stacks("omnirelay-bench-realtime-", work, keep=keep_logs)
