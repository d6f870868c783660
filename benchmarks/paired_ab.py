"""``omnirelay bench ab``: is code tree B faster than code tree A? A paired TTFT / e2e comparison.

One stack of the thinker-only pipeline from each tree (each with its own NATS), engines on one core
and everything else on the others, in the paired runner (:mod:`benchmarks.paired`): each round is
one block of sequential streamed requests per tree, the stack not being measured paused. The
statistic is the median over block pairs of (B's block median − A's block median), milliseconds,
with a bootstrap 95 % interval.
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_PIPELINE,
    Processes,
    RequestTiming,
    engine_env,
    front_end_cores,
    isolate_engines,
    run_with_stacks,
    start_stack,
)
from benchmarks.paired import Figure, Paired, render, run_sequential, write_json
from libs.common.pipeline import load_pipeline

PROMPT = "Tell me a short story about a lighthouse keeper."


def _ms(attr: str, stat: Callable[[list[float]], float]) -> Callable[[list[RequestTiming]], float]:
    """``stat`` of the block's ``attr`` (``ttft_s``, ``e2e_s``) in milliseconds."""
    return lambda block: stat([getattr(t, attr) * 1e3 for t in block])


FIGURES: tuple[Figure[list[RequestTiming]], ...] = (
    Figure("TTFT p50", "ms", _ms("ttft_s", statistics.median), compare="difference"),
    Figure("TTFT mean", "ms", _ms("ttft_s", statistics.fmean), compare="difference"),
    Figure("e2e p50", "ms", _ms("e2e_s", statistics.median), compare="difference"),
    Figure("e2e mean", "ms", _ms("e2e_s", statistics.fmean), compare="difference"),
)
"""A block's figures, compared B − A per block pair."""


@dataclass(frozen=True)
class Interval:
    """The median of per-pair differences and its bootstrap 95 % interval (the values' unit)."""

    median: float
    low: float
    high: float
    pairs: int


def bootstrap_interval(diffs: Sequence[float], resamples: int = 2000, seed: int = 0) -> Interval:
    """The median of ``diffs`` (one per block pair) with the 2.5 and 97.5 % points of the medians
    of ``resamples`` resamples drawn with replacement."""
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return Interval(
        statistics.median(diffs), boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1], len(diffs)
    )


def report(trees: dict[str, Path], paired: Paired[list[RequestTiming]]) -> str:
    """What A and B are, the runner's table of block figures (without the per-pair values), and
    the B − A median of TTFT p50 and e2e p50 over block pairs with its bootstrap interval."""
    lines = [f"{name} = {tree}" for name, tree in trees.items()]
    lines.append(render(paired, FIGURES, per_round=False))
    for f in (FIGURES[0], FIGURES[2]):
        d = bootstrap_interval(paired.per_round(f, "B", "block"))
        lines.append(
            f"{f.name} B − A per block pair: {d.median:+.2f} ms "
            f"(95 % CI {d.low:+.2f} .. {d.high:+.2f}, {d.pairs} pairs)"
        )
    return "\n".join(lines)


def run_ab_bench(
    tree_a: Path,
    tree_b: Path,
    blocks: int,
    block: int,
    max_tokens: int,
    json_path: Path | None = None,
    pipeline_path: Path = DEFAULT_PIPELINE,
) -> int:
    """Start a stack from each tree, run ``blocks`` block pairs, print the report (and, with
    ``json_path``, write every block's timings there); 0 on success, 1 on failure."""
    trees = {"A": tree_a.resolve(), "B": tree_b.resolve()}
    pipeline = load_pipeline(pipeline_path)
    core = sorted(os.sched_getaffinity(0))[0]

    def work(procs: Processes, data_dir: Path) -> None:
        env = engine_env(pipeline, core)
        with front_end_cores(core):
            sides = {
                n: start_stack(procs, n, pipeline_path.resolve(), env, data_dir, tree=t)
                for n, t in trees.items()
            }
        isolate_engines([p for s in sides.values() for p in s.processes.values()], core)
        model = pipeline.served_model_name
        paired = run_sequential(
            sides, "block", block, blocks, FIGURES, model, max_tokens, PROMPT, settle_first=1
        )
        print(report(trees, paired), flush=True)
        if json_path:
            write_json(json_path, {"trees": trees, "block": block, "max_tokens": max_tokens}, paired, FIGURES)

    return run_with_stacks("omnirelay-bench-ab-", work)
