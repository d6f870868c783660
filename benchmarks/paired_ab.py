"""``omnirelay bench ab``: is code tree B faster than code tree A? A paired TTFT / e2e comparison.

Single ``omnirelay bench gateway`` runs drift with the machine (direct vLLM's own TTFT p50 moved between
4.6 and 9.5 ms in one morning), far more than a change worth a few tenths of a millisecond. This
bench starts one stack of the thinker-only pipeline from each tree (each with its own NATS),
engines on one core and everything else on the others, and alternates blocks of sequential
streamed requests between them (A B, B A, ...) with the stack not being measured paused. Each
adjacent pair of blocks ran under nearly the same machine conditions, so the statistic is the
median over block pairs of (B's block median − A's block median), with a bootstrap 95 % interval.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_PIPELINE,
    Processes,
    RequestTiming,
    Stack,
    engine_env,
    front_end_cores,
    isolate_engines,
    log,
    run_with_stacks,
    settle,
    start_stack,
    timed_request,
)
from libs.common.pipeline import load_pipeline

PROMPT = "Tell me a short story about a lighthouse keeper."


@dataclass(frozen=True)
class PairedDiff:
    """Median over block pairs of B − A (seconds) and its bootstrap 95 % interval."""

    median_s: float
    low_s: float
    high_s: float
    pairs: int


def paired_difference(
    a_blocks: list[list[float]], b_blocks: list[list[float]], resamples: int = 2000, seed: int = 0
) -> PairedDiff:
    """Blocks i of A and B ran back to back; the difference of their medians is one observation."""
    diffs = [statistics.median(b) - statistics.median(a) for a, b in zip(a_blocks, b_blocks, strict=True)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return PairedDiff(
        statistics.median(diffs), boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1], len(diffs)
    )


async def _block(side: Stack, client, model: str, n: int, max_tokens: int) -> list[RequestTiming]:
    side.process.resume()
    try:
        await settle(side.name, model, client, 1, max_tokens)
        return [await timed_request(client, model, PROMPT, max_tokens) for _ in range(n)]
    finally:
        side.process.pause()


async def _measure(sides: dict[str, Stack], model: str, blocks: int, block: int, max_tokens: int):
    from openai import AsyncOpenAI

    clients = {
        n: AsyncOpenAI(base_url=s.base_url, api_key="bench", timeout=120.0, max_retries=0)
        for n, s in sides.items()
    }
    out: dict[str, list[list[RequestTiming]]] = {n: [] for n in sides}
    try:
        for i in range(blocks):
            for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                timings = await _block(sides[name], clients[name], model, block, max_tokens)
                failed = [t.error for t in timings if not t.ok]
                if failed:
                    raise RuntimeError(f"{name}: {failed[0]}")
                out[name].append(timings)
            if (i + 1) % 10 == 0:
                log(f"{i + 1}/{blocks} block pairs")
    finally:
        for c in clients.values():
            await c.close()
    return out


def report(trees: dict[str, Path], blocks: dict[str, list[list[RequestTiming]]]) -> str:
    """Per side: requests, TTFT and e2e p50 / mean (ms); then B − A per block pair with its interval."""
    rows = [f"{'':<4}{'tree':<40}{'n':>6}{'TTFT p50':>10}{'TTFT mean':>11}{'e2e p50':>10}{'e2e mean':>10}"]
    for name in ("A", "B"):
        ts = [t for b in blocks[name] for t in b]
        ttft = [t.ttft_s * 1e3 for t in ts if t.ttft_s is not None]
        e2e = [t.e2e_s * 1e3 for t in ts]
        rows.append(
            f"{name:<4}{str(trees[name])[-39:]:<40}{len(ts):>6}{statistics.median(ttft):>10.2f}"
            f"{statistics.fmean(ttft):>11.2f}{statistics.median(e2e):>10.2f}{statistics.fmean(e2e):>10.2f}"
        )
    for label, attr in (("TTFT", "ttft_s"), ("e2e", "e2e_s")):
        a = [[getattr(t, attr) for t in b] for b in blocks["A"]]
        b = [[getattr(t, attr) for t in b] for b in blocks["B"]]
        d = paired_difference(a, b)
        rows.append(
            f"{label} B − A per block pair: {d.median_s * 1e3:+.2f} ms "
            f"(95 % CI {d.low_s * 1e3:+.2f} .. {d.high_s * 1e3:+.2f}, {d.pairs} pairs)"
        )
    return "\n".join(rows)


def run_ab_bench(
    tree_a: Path,
    tree_b: Path,
    blocks: int,
    block: int,
    max_tokens: int,
    pipeline_path: Path = DEFAULT_PIPELINE,
) -> int:
    trees = {"A": tree_a.resolve(), "B": tree_b.resolve()}
    for name, tree in trees.items():
        if not (tree / "services" / "cli.py").is_file():
            log(f"tree {name} ({tree}) is not an omnirelay checkout")
            return 2
    pipeline = load_pipeline(pipeline_path)
    core = sorted(os.sched_getaffinity(0))[0]

    def work(procs: Processes, data_dir: Path) -> None:
        env = engine_env(pipeline, core)
        with front_end_cores(core):
            sides = {
                n: start_stack(procs, n, pipeline_path.resolve(), env, data_dir, tree=t)
                for n, t in trees.items()
            }
        isolate_engines(procs.items, core)
        for s in sides.values():
            s.process.pause()
        result = asyncio.run(_measure(sides, pipeline.served_model_name, blocks, block, max_tokens))
        print(report(trees, result), flush=True)

    return run_with_stacks("omnirelay-bench-ab-", work)
