"""The pure parts of ``omnirelay bench token-cost`` (benchmarks/token_cost.py): per-token CPU,
its figures' per-round ratios in the paired runner, their median and range, the sanity of a
sample, the baseline file and the guard's comparison. Expected values are worked out by hand in
each test."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.harness import RequestTiming
from benchmarks.paired import Paired, Run, Spread, spread
from benchmarks.token_cost import (
    Baseline,
    Sample,
    baseline_json,
    figures,
    parse_baseline,
    sample_of,
    sanity_problems,
    summarize,
    violations,
)


def _sample(cpu_s: dict[str, float], tokens: int = 1000, tpot: float | None = 2.0) -> Sample:
    return Sample(
        requests=10,
        completed=10,
        tokens=tokens,
        short=0,
        chunks=tokens,
        cpu_s=cpu_s,
        tpot_p50_ms=tpot,
        wall_s=1.0,
    )


def test_cpu_per_token_is_microseconds_per_output_token():
    s = _sample({"gateway": 0.03, "worker": 0.02}, tokens=1000)
    assert s.cpu_us_per_token() == pytest.approx(50.0)  # 0.05 s / 1000 tokens
    assert s.cpu_us_per_token("gateway") == pytest.approx(30.0)
    assert math.isnan(_sample({"server": 0.1}, tokens=0).cpu_us_per_token())


def _paired(*rounds: tuple[int, Sample, Sample]) -> Paired[Sample]:
    """Rounds of (concurrency, A's sample, B's sample), numbered per concurrency."""
    paired: Paired[Sample] = Paired(("A", "B"), "A", tuple(dict.fromkeys(f"c={c}" for c, _, _ in rounds)))
    seen: dict[int, int] = {}
    for c, a, b in rounds:
        r = seen[c] = seen.get(c, -1) + 1
        paired.runs += [Run("A", f"c={c}", r, a), Run("B", f"c={c}", r, b)]
    return paired


def _ratios(a: Sample, b: Sample) -> dict[str, float]:
    figs = figures(list(b.cpu_s))
    return {f: s.median for f, s in summarize(_paired((1, a, b)), figs)[1].items()}


def test_ratios_are_b_over_a_per_figure():
    ref = _sample({"server": 0.01}, tpot=0.5)  # 10 µs/token
    omni = _sample({"gateway": 0.03, "worker": 0.02}, tpot=2.0)  # 30 + 20 µs/token
    r = _ratios(ref, omni)
    assert r["cpu"] == pytest.approx(5.0)
    assert r["cpu:gateway"] == pytest.approx(3.0)  # the reference has no gateway: over its sum
    assert r["cpu:worker"] == pytest.approx(2.0)
    assert r["tpot"] == pytest.approx(4.0)
    a = _sample({"gateway": 0.02, "worker": 0.04})
    b = _sample({"gateway": 0.03, "worker": 0.02})
    assert _ratios(a, b)["cpu:gateway"] == pytest.approx(1.5)  # same role on both sides
    assert _ratios(a, b)["cpu:worker"] == pytest.approx(0.5)
    assert "tpot" not in _ratios(_sample({"s": 0.01}, tpot=None), omni)


def test_spread_is_median_and_range():
    s = spread([1.2, 3.0, 1.0, 1.1])
    assert s is not None
    assert (s.median, s.low, s.high, s.n) == (pytest.approx(1.15), 1.0, 3.0, 4)
    assert s.relative == pytest.approx(2.0 / 1.15)
    assert spread([]) is None


def test_summarize_takes_the_median_of_per_round_ratios_per_concurrency():
    ref = _sample({"server": 0.01})
    paired = _paired(
        (1, ref, _sample({"gateway": 0.02, "worker": 0.01})),  # cpu 3
        (1, ref, _sample({"gateway": 0.05, "worker": 0.01})),  # cpu 6
        (1, ref, _sample({"gateway": 0.03, "worker": 0.01})),  # cpu 4
        (16, ref, _sample({"gateway": 0.01, "worker": 0.01})),  # cpu 2
    )
    got = summarize(paired, figures(["gateway", "worker"]))
    cpu = got[1]["cpu"]
    assert (cpu.median, cpu.low, cpu.high, cpu.n) == (
        pytest.approx(4.0),
        pytest.approx(3.0),
        pytest.approx(6.0),
        3,
    )
    assert cpu.values == pytest.approx((3.0, 6.0, 4.0))  # in round order
    assert got[16]["cpu"].median == pytest.approx(2.0) and got[16]["cpu"].n == 1


def _timing(
    tokens: int, error: str | None = None, tpot_s: float = 0.001, chunks: int | None = None
) -> RequestTiming:
    return RequestTiming(
        sent_s=0.0,
        done_s=1.0,
        first_token_s=None if error else 0.1,
        last_token_s=None if error else 0.1 + tpot_s * (tokens - 1),
        tokens=tokens,
        chunks=tokens if chunks is None else chunks,
        error=error,
    )


def test_sample_of_counts_only_completed_requests_and_short_ones():
    timings = [_timing(64), _timing(64, tpot_s=0.003), _timing(10), _timing(0, error="boom")]
    s = sample_of(timings, {"server": 0.5}, 2.0, max_tokens=64)
    assert (s.requests, s.completed, s.tokens, s.short, s.chunks) == (4, 3, 138, 1, 138)
    assert s.tpot_p50_ms == pytest.approx(1.0)  # the median of 1, 3 and 1 ms
    assert s.error_sample == "boom"


def test_sanity_flags_missing_requests_and_wrong_token_counts():
    good = sample_of([_timing(64)] * 4, {"server": 0.1}, 1.0, 64)
    assert sanity_problems(good, 4, 64) == []
    assert sanity_problems(good, 5, 64)  # one request never sent
    failed = sample_of([_timing(64)] * 3 + [_timing(0, "x")], {"server": 0.1}, 1.0, 64)
    assert any("3 of 4" in p for p in sanity_problems(failed, 4, 64))
    short = sample_of([_timing(64)] * 3 + [_timing(63)], {"server": 0.1}, 1.0, 64)
    assert any("255 tokens" in p for p in sanity_problems(short, 4, 64))
    # usage says 64 each, but the client saw fewer content chunks: a server that miscounts
    batched = sample_of([_timing(64)] * 3 + [_timing(64, chunks=32)], {"server": 0.1}, 1.0, 64)
    assert sanity_problems(batched, 4, 64) == ["the client counted 224 content chunks, expected 4 × 64"]
    idle = sample_of([_timing(64)] * 4, {"server": 0.0}, 1.0, 64)
    assert any("CPU" in p for p in sanity_problems(idle, 4, 64))


def _baseline(cpu_at_1: float, cpu_at_16: float) -> Baseline:
    return Baseline(
        date="2026-11-26T10:00:00Z",
        commit="abc",
        rounds=5,
        max_tokens=64,
        requests={1: 48, 16: 192},
        ratios={
            1: {
                "cpu": Spread(cpu_at_1, cpu_at_1 - 0.5, cpu_at_1 + 0.5, 5),
                "tpot": Spread(9.0, 8.0, 10.0, 5),
            },
            16: {"cpu": Spread(cpu_at_16, cpu_at_16, cpu_at_16, 5)},
        },
        note="n",
    )


def test_baseline_round_trips_through_its_file_text():
    b = _baseline(4.0, 2.5)
    text = baseline_json(b)
    doc = json.loads(text)
    assert doc["ratios"]["1"]["cpu"]["median"] == 4.0 and doc["requests"]["16"] == 192
    assert doc["ratios"]["1"]["cpu"]["relative"] == pytest.approx(0.25)  # (4.5 − 3.5) ÷ 4
    assert parse_baseline(text) == b
    with pytest.raises(ValueError):
        parse_baseline('{"date": "x"}')
    with pytest.raises(ValueError):
        parse_baseline("not json")


def test_violations_only_above_baseline_times_factor():
    b = _baseline(4.0, 2.0)
    within = {1: {"cpu": Spread(5.9, 5.0, 7.0, 2)}, 16: {"cpu": Spread(3.0, 2.9, 3.1, 2)}}
    assert violations(within, b, factor=1.5) == []  # 5.9 ≤ 6.0, 3.0 ≤ 3.0
    over = {1: {"cpu": Spread(6.1, 6.0, 6.2, 2)}, 16: {"cpu": Spread(3.0, 2.9, 3.1, 2)}}
    got = violations(over, b, factor=1.5)
    assert len(got) == 1 and got[0].startswith("c=1 cpu: ratio 6.10")
    assert violations(over, b, factor=1.6) == []
    # the guard holds the CPU figure only unless told otherwise
    assert violations({1: {"cpu": Spread(4, 4, 4, 1), "tpot": Spread(99, 99, 99, 1)}}, b) == []
    assert violations({1: {"cpu": Spread(4, 4, 4, 1), "tpot": Spread(99, 99, 99, 1)}}, b, figures=("tpot",))


def test_violations_name_a_level_without_baseline_or_measurement():
    b = _baseline(4.0, 2.0)
    assert violations({64: {"cpu": Spread(1, 1, 1, 1)}}, b) == ["c=64 cpu: no baseline"]
    assert violations({1: {"tpot": Spread(1, 1, 1, 1)}}, b) == ["c=1 cpu: not measured"]
