"""The report of a paired ``omnirelay bench log-stats`` run, on hand-computed samples."""

from __future__ import annotations

from benchmarks.harness import RequestTiming
from benchmarks.log_stats_cost import OFF, ON, report
from benchmarks.paired import Paired, Run


def _round(*e2e_s: float) -> list[RequestTiming]:
    return [RequestTiming(sent_s=0.0, done_s=e, first_token_s=e / 2, last_token_s=e, tokens=2) for e in e2e_s]


def test_report_states_the_paired_ratio_of_the_mean_as_the_cost() -> None:
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
    # the median of the per-round ratios 1.01 and 1.00
    assert "--log-stats costs +0.5% (rounds +0.0% to +1.0%) mean end-to-end latency; target <= +1%" in text
    assert "/metrics served in 1.00 ms (log-stats off), 2.00 ms (log-stats on)" in text


def test_report_without_paired_rounds_says_so() -> None:
    paired: Paired[list[RequestTiming]] = Paired((OFF, ON), OFF, ("sequential",))
    paired.runs.append(Run(OFF, "sequential", 0, _round(0.1)))
    assert "--log-stats costs not measured" in report(paired, {OFF: 1.0, ON: 1.0})
