"""``omnirelay bench sync``: what JetStream's ``sync_interval`` and a 3-node cluster cost.

Four NATS setups, each serving an identical thinker-only stack (engines bound to the same core;
the stacks not being measured are paused with SIGSTOP):

- ``1 server, 2m``: nats-server's default (fsync every 2 minutes);
- ``1 server, 1s``: fsync every second;
- ``1 server, always``: fsync after every write, before the acknowledgement;
- ``3 nodes, always``: a JetStream cluster, streams and KV buckets with 3 replicas.

Two measurements per setup:

1. **Publish**: sequential JetStream publishes of a 1 KiB message to a work-queue file stream,
   each waiting for its acknowledgement (what the gateway, orchestrator and workers do) —
   milliseconds per publish, p50 / p90 / p99, ``time.perf_counter()`` of this process.
2. **End to end**: paired rounds (:mod:`benchmarks.paired`) of sequential streamed chat requests
   through the gateway, alternating between the setups (A B C D, D C B A, ...): per round mean /
   p50 / p99 latency and p50 time to first token with the median of the per-round ratios to
   ``1 server, 2m``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_PIPELINE,
    PROMPTS,
    Processes,
    RequestTiming,
    engine_env,
    log,
    percentile,
    run_with_stacks,
    start_stack,
)
from benchmarks.log_stats_cost import e2e_figures
from benchmarks.paired import Figure, Paired, render, run_sequential, table, write_json
from libs.common.bus import server_urls
from libs.common.pipeline import load_pipeline
from libs.stack.local_stack import Stack

SETUPS = {
    "1 server, 2m": (1, "2m"),
    "1 server, 1s": (1, "1s"),
    "1 server, always": (1, "always"),
    "3 nodes, always": (3, "always"),
}
"""Name → (NATS servers, ``sync_interval``); the first is the baseline."""
PAYLOAD = b"x" * 1024


async def publish_latencies_ms(nats_url: str, count: int) -> list[float]:
    """``count`` sequential acknowledged publishes to a fresh work-queue file stream with one
    replica per server in ``nats_url``; milliseconds each."""
    import nats
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    servers = server_urls(nats_url)
    nc = await nats.connect(servers=servers)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name="SYNC_BENCH",
                subjects=["syncbench.in"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                num_replicas=len(servers),
            )
        )
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            await js.publish("syncbench.in", PAYLOAD)
            out.append((time.perf_counter() - t0) * 1e3)
        await js.delete_stream("SYNC_BENCH")
        return out
    finally:
        await nc.close()


FIGURES = (
    *e2e_figures(),
    Figure("TTFT p50", "ms", lambda timings: percentile([t.ttft_s * 1e3 for t in timings], 50)),
)
WARMUP = 8
"""Unmeasured requests per setup first."""


def _start(procs: Processes, data_dir: Path, env: dict[str, str]) -> dict[str, Stack]:
    """A paused stack on each of :data:`SETUPS`."""
    sides: dict[str, Stack] = {}
    for name, (nodes, sync) in SETUPS.items():
        sides[name] = start_stack(
            procs,
            name.replace(",", ""),
            DEFAULT_PIPELINE,
            env,
            data_dir,
            nats_nodes=nodes,
            sync_interval=sync,
        )
        sides[name].pause()
    return sides


def run_sync_bench(
    rounds: int, per_round: int, max_tokens: int, publishes: int, json_path: Path | None = None
) -> int:
    """Start the four stacks, measure, print both tables (and the JSON to ``json_path``)."""
    pipeline = load_pipeline(DEFAULT_PIPELINE)
    model = pipeline.served_model_name
    core = sorted(os.sched_getaffinity(0))[0]

    def work(procs: Processes, data_dir: Path) -> None:
        sides = _start(procs, data_dir, engine_env(pipeline, core))
        publish = {}
        for name, side in sides.items():  # the stacks are paused: only the bench client and NATS run
            publish[name] = asyncio.run(publish_latencies_ms(side.nats_url, publishes))
            log(f"{name}: {publishes} publishes, p50 {percentile(publish[name], 50):.2f} ms")

        paired = run_sequential(
            sides, "sequential", per_round, rounds, FIGURES, model, max_tokens, PROMPTS[0], WARMUP, 2
        )
        print(report(publish, paired), flush=True)
        if json_path:
            options = {"per_round": per_round, "max_tokens": max_tokens, "publish_ms": publish}
            write_json(json_path, options, paired, FIGURES)

    return run_with_stacks("omnirelay-bench-sync-", work)


def report(publish_ms: dict[str, list[float]], paired: Paired[list[RequestTiming]]) -> str:
    """The publish table (ms) and the runner's end-to-end table."""
    publish = [
        (name, str(len(xs)), *(f"{percentile(xs, q):.2f}" for q in (50, 90, 99)))
        for name, xs in publish_ms.items()
    ]
    return "\n".join(
        [
            "JetStream publish + ack, 1 KiB, sequential",
            table(("setup", "n", "p50 ms", "p90 ms", "p99 ms"), publish),
            "",
            "end to end, sequential streamed requests",
            render(paired, FIGURES),
        ]
    )
