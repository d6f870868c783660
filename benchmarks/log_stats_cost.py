"""``omnirelay bench log-stats``: what ``--log-stats`` costs, measured A/B on the same workload.

Two identical stacks of the thinker-only pipeline (each with its own NATS), one with
``--log-stats`` and one without, engines bound to the same core; the stack not being measured is
paused (SIGSTOP). Rounds of sequential streamed requests alternate between them (A B, B A, ...).
Prints mean / p50 / p99 end-to-end latency per side, the mean delta and Welch's t, and the time a
worker takes to serve ``/metrics`` (median of repeated scrapes).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.harness import (
    DEFAULT_PIPELINE,
    Processes,
    RequestTiming,
    Stack,
    engine_env,
    log,
    percentile,
    run_with_stacks,
    start_stack,
    timed_request,
)
from libs.common.pipeline import load_pipeline
from libs.stack.bus_state import snapshot

OFF, ON = "log-stats off", "log-stats on"
PROMPT = "Describe the harbour at dawn in a few sentences."


def welch_t(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t statistic of mean(b) − mean(a) and its Welch–Satterthwaite degrees of freedom."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return 0.0, float(len(a) + len(b) - 2)
    t = (statistics.fmean(b) - statistics.fmean(a)) / se
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df


def t_critical_95(df: float) -> float:
    """Two-sided 5 % critical value of Student's t (table below 30 degrees of freedom, normal above)."""
    table = {
        1: 12.71,
        2: 4.30,
        3: 3.18,
        4: 2.78,
        5: 2.57,
        6: 2.45,
        8: 2.31,
        10: 2.23,
        15: 2.13,
        20: 2.09,
        30: 2.04,
    }
    if df >= 30:
        return 1.96
    return table[max(k for k in table if k <= max(df, 1))]


async def _round(side: Stack, model: str, n: int, max_tokens: int) -> list[RequestTiming]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=side.base_url, api_key="bench", timeout=120.0, max_retries=0)
    side.process.resume()
    try:
        return [await timed_request(client, model, PROMPT, max_tokens) for _ in range(n)]
    finally:
        side.process.pause()
        await client.close()


def _scrape_ms(side: Stack, pipeline, repeats: int = 50) -> float:
    """Median time to fetch a thinker worker's ``/metrics``, milliseconds."""
    side.process.resume()
    try:
        snap = asyncio.run(snapshot(side.nats_url, pipeline))
        url = next(s["metrics_url"] for s in snap["services"] if s["service"] == "worker" and s["stage"] == 0)
        times = []
        with httpx.Client() as client:
            for _ in range(repeats):
                t0 = time.perf_counter()
                client.get(url).raise_for_status()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    finally:
        side.process.pause()


def run_log_stats_bench(
    rounds: int, per_round: int, max_tokens: int, pipeline_path: Path = DEFAULT_PIPELINE
) -> int:
    pipeline = load_pipeline(pipeline_path)
    core = sorted(os.sched_getaffinity(0))[0]

    def work(procs: Processes, data_dir: Path) -> None:
        env = engine_env(pipeline, core)
        sides = {
            n: start_stack(
                procs, n, pipeline_path, env, data_dir, ["--log-stats" if n == ON else "--no-log-stats"]
            )
            for n in (OFF, ON)
        }
        for s in sides.values():
            s.process.pause()
        model = pipeline.served_model_name
        for s in sides.values():  # warm-up
            asyncio.run(_round(s, model, 8, max_tokens))
        e2e: dict[str, list[float]] = {OFF: [], ON: []}
        for r in range(rounds):
            for name in (OFF, ON) if r % 2 == 0 else (ON, OFF):
                timings = asyncio.run(_round(sides[name], model, per_round, max_tokens))
                failed = [t.error for t in timings if not t.ok]
                if failed:
                    raise RuntimeError(f"{name}: {failed[0]}")
                e2e[name] += [t.e2e_s for t in timings]
            log(f"round {r + 1}/{rounds} done")
        scrape = {n: _scrape_ms(s, pipeline) for n, s in sides.items()}
        print(report(e2e, scrape), flush=True)

    return run_with_stacks("omnirelay-bench-log-stats-", work)


def report(e2e: dict[str, list[float]], scrape_ms: dict[str, float]) -> str:
    """The comparison table and verdict (latencies in ms)."""
    a, b = e2e[OFF], e2e[ON]
    rows = [f"{'':<16}{'n':>6}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'/metrics ms':>13}"]
    for name, xs in ((OFF, a), (ON, b)):
        rows.append(
            f"{name:<16}{len(xs):>6}{statistics.fmean(xs) * 1e3:>10.2f}{percentile(xs, 50) * 1e3:>10.2f}"
            f"{percentile(xs, 99) * 1e3:>10.2f}{scrape_ms[name]:>13.2f}"
        )
    t, df = welch_t(a, b)
    delta = (statistics.fmean(b) / statistics.fmean(a) - 1) * 100
    p50 = (percentile(b, 50) / percentile(a, 50) - 1) * 100
    p99 = (percentile(b, 99) / percentile(a, 99) - 1) * 100
    sig = "significant" if abs(t) > t_critical_95(df) else "not significant"
    rows.append(
        f"--log-stats costs {delta:+.1f}% mean ({p50:+.1f}% p50, {p99:+.1f}% p99) end-to-end latency; "
        f"Welch's t = {t:.2f} (df {df:.0f}), {sig} at alpha = 0.05; target <= +1% mean"
    )
    return "\n".join(rows)
