"""``omnirelay bench nice``: what running the engines at a higher nice value gives the control plane
under load, and what it costs the engines (prints a table).

One stack of the fault suite's pipeline (two replicas of every stage,
:data:`benchmarks.chat_streams.TWO_REPLICA_PIPELINE`) serves a steady load — text streams of 1,900
tokens and audio streams of 300, each sent again as soon as it ends — in blocks that alternate the
engines' nice value (``0``, ``N``, ``N``, ``0``, …: the paired runner's rounds, :mod:`benchmarks.paired`).
Before each block the bench sets the nice value of every thread of every engine process of the
stack itself, so both arms run on the same processes, minutes apart: lowering it back to 0 needs
``CAP_SYS_NICE`` (root). Each block measures, on one clock (monotonic):

- ``broker``: a JetStream publish to a memory stream of the stack's server every 100 ms, until its
  acknowledgement (what every service's heartbeat, admission and chunk publish waits for);
- ``gateway``: ``GET /health`` every 100 ms (the gateway's event loop);
- ``pause``: the longest gap between two chunks of one client stream;
- ``tok/s``: tokens the clients received per second of the block.

Each figure (:data:`FIGURES`) is compared per round as nice N ÷ nice 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.chat_streams import MODEL, TWO_REPLICA_PIPELINE, Seen, send
from benchmarks.harness import Processes, is_engine, log, percentile, run_with_stacks, start_stack
from benchmarks.paired import Figure, render, run_paired, write_json
from benchmarks.process_table import descendants
from libs.stack.local_stack import Stack

PROBE_EVERY_S = 0.1
TEXT_STREAMS, TEXT_TOKENS = 6, 1900
AUDIO_STREAMS, AUDIO_TOKENS = 2, 300
PROBE_STREAM, PROBE_SUBJECT = "BENCH_NICE_PROBE", "bench.nice.probe"
WARMUP_S = 20.0
"""The unmeasured block at nice 0 first (at most ``--block-s``), seconds."""


@dataclass(frozen=True)
class Block:
    """One block of load at one nice value: the probes' answer times (ms), the longest pause of
    a stream (s), the tokens the clients received per second, the streams that failed."""

    broker_ms: tuple[float, float, float]
    """p50, p99 and max."""
    gateway_ms: tuple[float, float, float]
    """p50, p99 and max."""
    pause_s: float
    tokens_per_s: float
    failed: int

    @classmethod
    def of(cls, broker_s: list[float], gateway_s: list[float], seen: list[Seen], wall_s: float) -> Block:
        def ms(xs: list[float]) -> tuple[float, float, float]:
            return percentile(xs, 50) * 1e3, percentile(xs, 99) * 1e3, max(xs) * 1e3

        gaps = [b - a for s in seen for a, b in zip(s.at, s.at[1:], strict=False)]
        tokens = sum(len(s.token_ids) for s in seen)
        failed = sum(s.error is not None for s in seen)
        return cls(ms(broker_s), ms(gateway_s), max(gaps, default=0.0), tokens / wall_s, failed)


FIGURES: tuple[Figure[Block], ...] = (
    *(
        Figure(f"broker {q}", "ms", lambda b, i=i: b.broker_ms[i])
        for i, q in enumerate(("p50", "p99", "max"))
    ),
    *(
        Figure(f"gateway {q}", "ms", lambda b, i=i: b.gateway_ms[i])
        for i, q in enumerate(("p50", "p99", "max"))
    ),
    Figure("longest pause", "s", lambda b: b.pause_s),
    Figure("tok/s", "", lambda b: b.tokens_per_s),
    Figure("failed streams", "", lambda b: b.failed, compare=""),
)


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


async def _probe(call: Callable[[], Awaitable[object]], out: list[float], until: float) -> None:
    """``call()`` every :data:`PROBE_EVERY_S` until ``until``, each answer's time into ``out``."""
    while time.monotonic() < until:
        t = time.monotonic()
        await call()
        out.append(time.monotonic() - t)
        await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - t)))


async def _load(client, out: list[Seen], until: float) -> None:
    """Keep the streams in flight until ``until`` (each sent again when it ends)."""

    async def user(audio: bool) -> None:
        while time.monotonic() < until:
            seen = Seen()
            out.append(seen)
            tokens = AUDIO_TOKENS if audio else TEXT_TOKENS
            await send(client, MODEL, seen, "Count to a thousand, slowly.", tokens, audio=audio)

    await asyncio.gather(
        *(user(False) for _ in range(TEXT_STREAMS)), *(user(True) for _ in range(AUDIO_STREAMS))
    )


async def run_block(stack: Stack, nice: int, seconds: float) -> Block:
    """Set the engines' nice value, then a block of ``seconds`` of load with both probes: a
    JetStream publish to a memory stream of the stack's server and the gateway's ``/health``."""
    import httpx
    import nats
    import openai

    log(f"block at nice {nice} ({set_engine_nice(stack, nice)} engine threads)")
    broker: list[float] = []
    gateway: list[float] = []
    seen: list[Seen] = []
    nc = await nats.connect(stack.nats_url.split(",")[0])
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.add_stream(name=PROBE_STREAM, subjects=[PROBE_SUBJECT], storage="memory", max_msgs=1000)
    client = openai.AsyncOpenAI(base_url=stack.api_url, api_key="bench", max_retries=0, timeout=300)
    health = f"{stack.base_url}/health"
    t0 = time.monotonic()
    until = t0 + seconds
    async with httpx.AsyncClient(timeout=30) as http:
        await asyncio.gather(
            _load(client, seen, until),
            _probe(lambda: js.publish(PROBE_SUBJECT, b"x", timeout=30), broker, until),
            _probe(lambda: http.get(health), gateway, until),
        )
    wall = time.monotonic() - t0
    await client.close()
    await nc.close()
    return Block.of(broker, gateway, seen, wall)


def run_nice_bench(rounds: int, nice: int, block_s: float, json_path: Path | None = None) -> int:
    """Start the stack, run ``rounds`` pairs of blocks alternating the arms, print the table (and
    the JSON to ``json_path``)."""
    arms = {"nice 0": 0, f"nice {nice}": nice}

    def work(procs: Processes, data_dir: Path) -> None:
        pipeline = data_dir / "nice.yaml"
        pipeline.write_text(TWO_REPLICA_PIPELINE)
        stack = start_stack(procs, "nice", pipeline, {"OMNIRELAY_ENGINE_NICE": "0"}, data_dir)

        async def warm_up(arm: str) -> None:  # once, at nice 0; not counted
            if arms[arm] == 0:
                await run_block(stack, 0, min(block_s, WARMUP_S))

        paired = asyncio.run(
            run_paired(
                list(arms),
                {"load": block_s},
                rounds,
                lambda arm, seconds, _: run_block(stack, arms[arm], seconds),
                warmup=warm_up,
                figures=FIGURES,
            )
        )
        stack.stop()
        print(render(paired, FIGURES), flush=True)
        if json_path:
            write_json(json_path, {"nice": nice, "block_s": block_s}, paired, FIGURES)

    return run_with_stacks("omnirelay-bench-nice-", work)
