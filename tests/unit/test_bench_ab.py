"""The paired statistic of `omnirelay bench ab`: block medians differenced pair by pair, and the
bootstrap interval of their median."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from benchmarks.harness import RequestTiming
from benchmarks.paired import Paired, Run
from benchmarks.paired_ab import FIGURES, bootstrap_interval


def _blocks(rng: random.Random, drift: list[float], shift: float) -> list[list[float]]:
    return [[d + shift + rng.gauss(0, 0.5) for _ in range(10)] for d in drift]


def _diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [statistics.median(y) - statistics.median(x) for x, y in zip(a, b, strict=True)]


def test_a_shift_is_found_under_drift_far_larger_than_it() -> None:
    rng = random.Random(1)
    drift = [5 + 4 * rng.random() for _ in range(60)]  # the machine: 5-9 ms from block to block
    d = bootstrap_interval(_diffs(_blocks(rng, drift, 0.0), _blocks(rng, drift, -0.4)))
    assert d.pairs == 60
    assert d.low <= d.median <= d.high
    assert d.high < 0  # B is faster, and the interval says so
    assert abs(d.median + 0.4) < 0.15


def test_identical_sides_give_an_interval_around_zero() -> None:
    rng = random.Random(2)
    drift = [5 + 4 * rng.random() for _ in range(60)]
    d = bootstrap_interval(_diffs(_blocks(rng, drift, 0.0), _blocks(rng, drift, 0.0)))
    assert d.low < 0 < d.high


def test_a_single_pair_is_its_own_difference() -> None:
    d = bootstrap_interval(_diffs([[1.0, 2.0, 3.0]], [[2.5, 3.5, 4.5]]))
    assert (d.median, d.low, d.high, d.pairs) == (1.5, 1.5, 1.5, 1)


def _block(*ttft_s: float) -> list[RequestTiming]:
    return [
        RequestTiming(sent_s=0.0, done_s=t + 0.05, first_token_s=t, last_token_s=t, tokens=1) for t in ttft_s
    ]


def test_a_block_pair_gives_b_minus_a_of_the_block_medians_in_ms() -> None:
    paired: Paired[list[RequestTiming]] = Paired(("A", "B"), "A", ("block",))
    paired.runs += [
        Run("A", "block", 0, _block(0.010, 0.012, 0.030)),  # TTFT median 12 ms
        Run("B", "block", 0, _block(0.011, 0.013, 0.001)),  # 11 ms
        Run("B", "block", 1, _block(0.020, 0.020)),  # 20 ms
        Run("A", "block", 1, _block(0.015, 0.017)),  # 16 ms
    ]
    ttft_p50, e2e_p50 = FIGURES[0], FIGURES[2]
    assert paired.per_round(ttft_p50, "B", "block") == pytest.approx([-1.0, 4.0])
    assert paired.per_round(e2e_p50, "B", "block") == pytest.approx([-1.0, 4.0])  # e2e = TTFT + 50 ms


def test_run_with_stacks_keeps_the_logs_of_a_failed_run_only(tmp_path, monkeypatch) -> None:
    from benchmarks import harness as bench

    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))
    used: list[Path] = []

    def fails(procs, data_dir: Path) -> None:
        used.append(data_dir)
        raise RuntimeError("a stack did not come up")

    def works(procs, data_dir: Path) -> None:
        used.append(data_dir)

    assert bench.run_with_stacks("t-", fails) == 1
    assert bench.run_with_stacks("t-", works) == 0
    assert used[0].is_dir() and not used[1].exists()
