"""The statistics of the --log-stats A/B benchmark, on hand-computed samples."""

from __future__ import annotations

import pytest

from benchmarks.log_stats_cost import OFF, ON, report, t_critical_95, welch_t


def test_welch_t_on_a_known_pair() -> None:
    a = [1.0, 2.0, 3.0, 4.0]  # mean 2.5, variance 5/3
    b = [2.0, 4.0, 6.0, 8.0]  # mean 5.0, variance 20/3
    t, df = welch_t(a, b)
    se = ((5 / 3) / 4 + (20 / 3) / 4) ** 0.5
    assert t == pytest.approx(2.5 / se)
    assert df == pytest.approx(((5 / 12 + 20 / 12) ** 2) / ((5 / 12) ** 2 / 3 + (20 / 12) ** 2 / 3))


def test_identical_samples_have_no_difference() -> None:
    assert welch_t([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])[0] == 0.0


def test_critical_values() -> None:
    assert t_critical_95(100) == 1.96 and t_critical_95(10) == 2.23 and t_critical_95(9) == 2.31


def test_report_states_the_delta_and_significance() -> None:
    text = report({OFF: [0.1, 0.1, 0.1, 0.1], ON: [0.1, 0.1, 0.1, 0.102]}, {OFF: 1.0, ON: 2.0})
    assert "+0.5% mean" in text and "not significant" in text and "target <= +1% mean" in text
