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
2. **End to end**: rounds of sequential streamed chat requests through the gateway, alternating
   between the setups (A B C D, D C B A, ...): mean / p50 / p99 latency and p50 time to first
   token, and the mean difference to ``1 server, 2m`` with Welch's t.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_PIPELINE,
    PROMPTS,
    Processes,
    RequestTiming,
    Stack,
    engine_env,
    log,
    percentile,
    run_with_stacks,
    settle,
    start_stack,
    timed_request,
)
from benchmarks.log_stats_cost import t_critical_95, welch_t
from libs.common.bus import server_urls
from libs.common.pipeline import load_pipeline

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


async def _round(side: Stack, model: str, n: int, max_tokens: int) -> list[RequestTiming]:
    """Resume ``side``, wait until two requests in a row succeed (a paused stack's registrations
    expire; they come back with the next heartbeat), time ``n`` sequential streamed requests,
    pause it again."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=side.base_url, api_key="bench", timeout=120.0, max_retries=0)
    side.process.resume()
    try:
        await settle(side.name, model, client, 2, max_tokens)
        return [await timed_request(client, model, PROMPTS[0], max_tokens) for _ in range(n)]
    finally:
        side.process.pause()
        await client.close()


def run_sync_bench(rounds: int, per_round: int, max_tokens: int, publishes: int) -> int:
    """Start the three stacks, measure, print both tables."""
    pipeline = load_pipeline(DEFAULT_PIPELINE)
    core = sorted(os.sched_getaffinity(0))[0]

    def work(procs: Processes, data_dir: Path) -> None:
        env = engine_env(pipeline, core)
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
            sides[name].process.pause()
        publish = {}
        for name, side in sides.items():  # the stacks are paused: only the bench client and NATS run
            publish[name] = asyncio.run(publish_latencies_ms(side.nats_url, publishes))
            log(f"{name}: {publishes} publishes, p50 {percentile(publish[name], 50):.2f} ms")
        model = pipeline.served_model_name
        for side in sides.values():  # warm-up
            asyncio.run(_round(side, model, 8, max_tokens))
        e2e: dict[str, list[float]] = {name: [] for name in sides}
        ttft: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                timings = asyncio.run(_round(sides[name], model, per_round, max_tokens))
                if failed := [t.error for t in timings if not t.ok]:
                    raise RuntimeError(f"{name}: {failed[0]}")
                e2e[name] += [t.e2e_s for t in timings]
                ttft[name] += [t.ttft_s for t in timings]
            log(f"round {r + 1}/{rounds} done")
        print(report(publish, e2e, ttft), flush=True)

    return run_with_stacks("omnirelay-bench-sync-", work)


def report(
    publish_ms: dict[str, list[float]], e2e_s: dict[str, list[float]], ttft_s: dict[str, list[float]]
) -> str:
    """Both tables (publish in ms; end-to-end and time to first token in ms) and the differences
    to the first setup."""
    rows = [
        "JetStream publish + ack, 1 KiB, sequential",
        f"{'setup':<18}{'n':>6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}",
    ]
    for name, xs in publish_ms.items():
        rows.append(
            f"{name:<18}{len(xs):>6}{percentile(xs, 50):>10.2f}{percentile(xs, 90):>10.2f}{percentile(xs, 99):>10.2f}"
        )
    rows += [
        "",
        "end to end, sequential streamed requests",
        f"{'setup':<18}{'n':>6}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'TTFT p50':>10}   vs {next(iter(e2e_s))}",
    ]
    base = next(iter(e2e_s.values()))
    for name, xs in e2e_s.items():
        line = (
            f"{name:<18}{len(xs):>6}{statistics.fmean(xs) * 1e3:>10.2f}{percentile(xs, 50) * 1e3:>10.2f}"
            f"{percentile(xs, 99) * 1e3:>10.2f}{percentile(ttft_s[name], 50) * 1e3:>10.2f}"
        )
        if xs is not base:
            t, df = welch_t(base, xs)
            delta = (statistics.fmean(xs) / statistics.fmean(base) - 1) * 100
            sig = "significant" if abs(t) > t_critical_95(df) else "not significant"
            line += f"   {delta:+.1f}% mean, Welch's t {t:.2f} (df {df:.0f}), {sig} at 0.05"
        rows.append(line)
    return "\n".join(rows)
