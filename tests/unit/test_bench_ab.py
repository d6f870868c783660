"""The paired statistic of `omnirelay bench ab`: block medians differenced pair by pair."""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks.paired_ab import paired_difference


def _blocks(rng: random.Random, drift: list[float], shift: float) -> list[list[float]]:
    return [[d + shift + rng.gauss(0, 0.5) for _ in range(10)] for d in drift]


def test_a_shift_is_found_under_drift_far_larger_than_it() -> None:
    rng = random.Random(1)
    drift = [5 + 4 * rng.random() for _ in range(60)]  # the machine: 5-9 ms from block to block
    a, b = _blocks(rng, drift, 0.0), _blocks(rng, drift, -0.4)
    d = paired_difference(a, b)
    assert d.pairs == 60
    assert d.low_s <= d.median_s <= d.high_s
    assert d.high_s < 0  # B is faster, and the interval says so
    assert abs(d.median_s + 0.4) < 0.15


def test_identical_sides_give_an_interval_around_zero() -> None:
    rng = random.Random(2)
    drift = [5 + 4 * rng.random() for _ in range(60)]
    d = paired_difference(_blocks(rng, drift, 0.0), _blocks(rng, drift, 0.0))
    assert d.low_s < 0 < d.high_s


def test_a_single_pair_is_its_own_difference() -> None:
    d = paired_difference([[1.0, 2.0, 3.0]], [[2.5, 3.5, 4.5]])
    assert (d.median_s, d.low_s, d.high_s, d.pairs) == (1.5, 1.5, 1.5, 1)


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
