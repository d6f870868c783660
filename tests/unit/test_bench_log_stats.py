"""The statistics of the --log-stats and sync_interval A/B benchmarks, on hand-computed samples:
Welch's t of the pooled means, and the report of a paired log-stats run."""

from __future__ import annotations

import pytest

from benchmarks.comparison_stats import mean_delta_line, t_critical_95, welch_t
from benchmarks.harness import RequestTiming
from benchmarks.log_stats_cost import OFF, ON, report
from benchmarks.paired import Paired, Run


def test_welch_t_on_a_known_pair() -> None:
    a = [1.0, 2.0, 3.0, 4.0]  # mean 2.5, variance 5/3
    b = [2.0, 4.0, 6.0, 8.0]  # mean 5.0, variance 20/3
    t, df = welch_t(a, b)
    se = ((5 / 3) / 4 + (20 / 3) / 4) ** 0.5
    assert t == pytest.approx(2.5 / se)
    assert df == pytest.approx(((5 / 12 + 20 / 12) ** 2) / ((5 / 12) ** 2 / 3 + (20 / 12) ** 2 / 3))


def test_identical_samples_have_no_difference() -> None:
    assert welch_t([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])[0] == 0.0
    assert mean_delta_line([1.0, 1.0], [1.0, 1.0]).startswith("+0.0% mean, Welch's t = 0.00")


def test_critical_values() -> None:
    assert t_critical_95(100) == 1.96 and t_critical_95(10) == 2.23 and t_critical_95(9) == 2.31
    assert t_critical_95(25) == 2.09 and t_critical_95(0.5) == 12.71


def _round(*e2e_s: float) -> list[RequestTiming]:
    return [RequestTiming(sent_s=0.0, done_s=e, first_token_s=e / 2, last_token_s=e, tokens=2) for e in e2e_s]


def test_report_states_the_paired_ratio_the_pooled_delta_and_significance() -> None:
    paired: Paired[list[RequestTiming]] = Paired((OFF, ON), OFF, ("sequential",))
    paired.runs += [
        Run(OFF, "sequential", 0, _round(0.1, 0.1)),
        Run(ON, "sequential", 0, _round(0.1, 0.102)),  # mean +1 %
        Run(ON, "sequential", 1, _round(0.1, 0.1)),
        Run(OFF, "sequential", 1, _round(0.1, 0.1)),
    ]
    text = report(paired, {OFF: 1.0, ON: 2.0})
    mean_row = next(line for line in text.splitlines() if line.startswith("e2e mean (ms)"))
    assert mean_row.split()[3:5] == ["100.5", "100.0"]  # the medians of the rounds (ms)
    assert "1.00x–1.01x" in mean_row and "1.01x, 1.00x" in mean_row
    assert "+0.5% mean" in text and "not significant" in text and "target <= +1% mean" in text
    assert "/metrics served in 1.00 ms (log-stats off), 2.00 ms (log-stats on)" in text
