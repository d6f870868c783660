"""``omnirelay bench log-stats``: what ``--log-stats`` costs, measured A/B on the same workload.

Two identical stacks of the thinker-only pipeline (each with its own NATS), one with
``--log-stats`` and one without, engines bound to the same core; the stack not being measured is
paused (SIGSTOP). The paired runner (:mod:`benchmarks.paired`) alternates rounds of sequential
streamed requests between them (A B, B A, ...). Prints the mean / p50 / p99 end-to-end latency
(ms) with the median of the per-round ratios on ÷ off, and the time a worker takes to serve
``/metrics`` (median of repeated scrapes).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.harness import (
    DEFAULT_PIPELINE,
    Processes,
    RequestTiming,
    engine_env,
    percentile,
    run_with_stacks,
    start_stack,
)
from benchmarks.paired import Figure, Paired, render, run_sequential, write_json
from libs.common.pipeline import PipelineConfig, load_pipeline
from libs.stack.local_stack import Stack

OFF, ON = "log-stats off", "log-stats on"
PROMPT = "Describe the harbour at dawn in a few sentences."
WARMUP = 8
"""Unmeasured requests per side first."""


def e2e_figures(label: str = "e2e") -> tuple[Figure[list[RequestTiming]], ...]:
    """The mean, p50 and p99 end-to-end latency of a round's requests (ms), compared as ratios."""

    def stat(fn: Callable[[list[float]], float]) -> Callable[[list[RequestTiming]], float]:
        return lambda timings: fn([t.e2e_s * 1e3 for t in timings])

    return (
        Figure(f"{label} mean", "ms", stat(statistics.fmean)),
        Figure(f"{label} p50", "ms", stat(lambda xs: percentile(xs, 50))),
        Figure(f"{label} p99", "ms", stat(lambda xs: percentile(xs, 99))),
    )


FIGURES = e2e_figures()


def _scrape_ms(side: Stack, pipeline: PipelineConfig, repeats: int = 50) -> float:
    """Median time to fetch a thinker worker's ``/metrics``, milliseconds."""
    from libs.stack.bus_state import snapshot

    side.resume()
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
        side.pause()


def report(paired: Paired[list[RequestTiming]], scrape_ms: dict[str, float]) -> str:
    """The runner's table, each side's ``/metrics`` time and the verdict: the median of the
    per-round ratios of the mean end-to-end latency, on ÷ off."""
    s = paired.compared(FIGURES[0], ON, "sequential")
    cost = (
        "not measured" if s is None else f"{s.median - 1:+.1%} (rounds {s.low - 1:+.1%} to {s.high - 1:+.1%})"
    )
    return "\n".join(
        [
            render(paired, FIGURES),
            f"/metrics served in {scrape_ms[OFF]:.2f} ms ({OFF}), {scrape_ms[ON]:.2f} ms ({ON}), median",
            f"--log-stats costs {cost} mean end-to-end latency; target <= +1%",
        ]
    )


def run_log_stats_bench(
    rounds: int,
    per_round: int,
    max_tokens: int,
    json_path: Path | None = None,
    pipeline_path: Path = DEFAULT_PIPELINE,
) -> int:
    """Start both stacks, run the rounds, print the report (and the JSON to ``json_path``)."""
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
        model = pipeline.served_model_name
        paired = run_sequential(
            sides, "sequential", per_round, rounds, FIGURES, model, max_tokens, PROMPT, WARMUP
        )
        scrape = {n: _scrape_ms(s, pipeline) for n, s in sides.items()}
        print(report(paired, scrape), flush=True)
        if json_path:
            write_json(json_path, {"per_round": per_round, "max_tokens": max_tokens}, paired, FIGURES)

    return run_with_stacks("omnirelay-bench-log-stats-", work)
