"""``omnirelay bench nice``: what running the engines at a higher nice value gives the control plane
under load, and what it costs the engines (prints a table).

One stack of the fault suite's pipeline (two replicas of every stage) serves a steady load — text
streams of 1,900 tokens and audio streams of 300, each sent again as soon as it ends — in blocks
that alternate the engines' nice value (``0``, ``N``, ``N``, ``0``, …). Between blocks the bench sets
the nice value of every thread of every engine process of the stack (vLLM's EngineCore and its
model runner) itself, so both arms run on the same processes, minutes apart: lowering it back to 0
needs ``CAP_SYS_NICE`` (root, as on this box). Each block measures, on one clock (monotonic):

- ``broker``: a JetStream publish to a memory stream of the stack's server every 100 ms, until its
  acknowledgement (what every service's heartbeat, admission and chunk publish waits for);
- ``gateway``: ``GET /health`` every 100 ms (the gateway's event loop);
- ``pause``: the longest gap between two chunks of one client stream;
- ``tok/s``: tokens the clients received per second of the block.

Per round (one block of each arm), the ratio nice N ÷ nice 0 of each; the verdict is the median of
the per-round ratios with their spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.fault_injection import PIPELINE_YAML
from benchmarks.fault_suite import Seen, send
from benchmarks.harness import Processes, Stack, is_engine, log, percentile, run_with_stacks, start_stack
from benchmarks.process_table import descendants

PROBE_EVERY_S = 0.1
TEXT_STREAMS, TEXT_TOKENS = 6, 1900
AUDIO_STREAMS, AUDIO_TOKENS = 2, 300
PROBE_STREAM, PROBE_SUBJECT = "BENCH_NICE_PROBE", "bench.nice.probe"


@dataclass
class Block:
    """One block of load at one nice value: what was measured, seconds unless named."""

    nice: int
    broker: list[float] = field(default_factory=list)
    gateway: list[float] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(len(s.token_ids) for s in self.seen) / self.wall_s

    @property
    def pause_s(self) -> float:
        gaps = [b - a for s in self.seen for a, b in zip(s.at, s.at[1:], strict=False)]
        return max(gaps, default=0.0)

    @property
    def failed(self) -> int:
        return sum(s.error is not None for s in self.seen)


def engine_threads(stack: Stack) -> list[int]:
    """The thread ids of every engine process (vLLM's) under the stack."""
    tids = []
    for pid in descendants(stack.root_pid):
        if is_engine(pid):
            with contextlib.suppress(OSError):
                tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return tids


def set_engine_nice(stack: Stack, nice: int) -> int:
    """Set every engine thread of ``stack`` to ``nice``; the number of threads set."""
    n = 0
    for tid in engine_threads(stack):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            n += 1
    return n


async def _probe_broker(nats_url: str, out: list[float], until: float) -> None:
    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.add_stream(name=PROBE_STREAM, subjects=[PROBE_SUBJECT], storage="memory", max_msgs=1000)
    try:
        while time.monotonic() < until:
            t = time.monotonic()
            await js.publish(PROBE_SUBJECT, b"x", timeout=30)
            out.append(time.monotonic() - t)
            await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - t)))
    finally:
        await nc.close()


async def _probe_gateway(health_url: str, out: list[float], until: float) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < until:
            t = time.monotonic()
            await client.get(health_url)
            out.append(time.monotonic() - t)
            await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - t)))


async def _load(client, model: str, out: list[Seen], until: float) -> None:
    """Keep the streams in flight until ``until`` (each sent again when it ends)."""

    async def user(audio: bool) -> None:
        while time.monotonic() < until:
            seen = Seen()
            out.append(seen)
            tokens = AUDIO_TOKENS if audio else TEXT_TOKENS
            await send(client, model, seen, "Count to a thousand, slowly.", tokens, audio=audio)

    await asyncio.gather(
        *(user(False) for _ in range(TEXT_STREAMS)), *(user(True) for _ in range(AUDIO_STREAMS))
    )


async def run_block(stack: Stack, model: str, nice: int, seconds: float) -> Block:
    import openai

    threads = set_engine_nice(stack, nice)
    log(f"block at nice {nice} ({threads} engine threads)")
    block = Block(nice)
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="bench", max_retries=0, timeout=300)
    t0 = time.monotonic()
    until = t0 + seconds
    health = stack.base_url.removesuffix("/v1") + "/health"
    await asyncio.gather(
        _load(client, model, block.seen, until),
        _probe_broker(stack.nats_url.split(",")[0], block.broker, until),
        _probe_gateway(health, block.gateway, until),
    )
    block.wall_s = time.monotonic() - t0
    await client.close()
    return block


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:.1f}"


def render(blocks: list[Block], nice: int) -> str:
    """The table: one row per block, then the medians of the per-round ratios."""
    lines = [
        "| block | nice | broker p50 / p99 / max ms | gateway p50 / p99 / max ms | longest pause s | tok/s | failed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, b in enumerate(blocks):
        lines.append(
            f"| {i + 1} | {b.nice} | {_ms(b.broker, 50)} / {_ms(b.broker, 99)} / {max(b.broker) * 1e3:.0f}"
            f" | {_ms(b.gateway, 50)} / {_ms(b.gateway, 99)} / {max(b.gateway) * 1e3:.0f}"
            f" | {b.pause_s:.2f} | {b.tokens_per_s:.0f} | {b.failed} |"
        )
    rounds = [
        (next(b for b in pair if b.nice == 0), next(b for b in pair if b.nice == nice))
        for pair in zip(blocks[::2], blocks[1::2], strict=True)
    ]
    metrics = {
        "broker p99": lambda b: percentile(b.broker, 99),
        "broker max": lambda b: max(b.broker),
        "gateway p99": lambda b: percentile(b.gateway, 99),
        "longest pause": lambda b: b.pause_s,
        "tok/s": lambda b: b.tokens_per_s,
    }
    lines += ["", f"| nice {nice} ÷ nice 0 | median of rounds | per round |", "| --- | --- | --- |"]
    for name, fn in metrics.items():
        ratios = [fn(b) / fn(a) if fn(a) else float("inf") for a, b in rounds]
        lines.append(
            f"| {name} | {statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} |"
        )
    return "\n".join(lines)


def run_nice_bench(rounds: int, nice: int, block_s: float) -> int:
    """Start the stack, run ``rounds`` pairs of blocks alternating the arms, print the table."""
    blocks: list[Block] = []

    def work(procs: Processes, data_dir: Path) -> None:
        pipeline = data_dir / "nice.yaml"
        pipeline.write_text(PIPELINE_YAML)
        env = {"OMNIRELAY_ENGINE_NICE": "0"}
        stack = start_stack(procs, "nice", pipeline, env, data_dir)
        model = "faults-model"
        asyncio.run(run_block(stack, model, 0, min(block_s, 20.0)))  # warm-up, not counted
        for r in range(rounds):
            for arm in (0, nice) if r % 2 == 0 else (nice, 0):
                blocks.append(asyncio.run(run_block(stack, model, arm, block_s)))
        stack.stop()

    status = run_with_stacks("omnirelay-bench-nice-", work)
    if status == 0:
        print(render(blocks, nice))
    return status
