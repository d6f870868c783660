"""The pure statistics of ``omnirelay bench gateway``: hand-computed cases, no servers."""

from __future__ import annotations

import pytest

from benchmarks.comparison_stats import (
    FIGURES,
    RoundResult,
    default_requests,
    late_first_token_share,
    machine_note,
    parse_concurrency,
    split_requests,
    verdict_line,
)
from benchmarks.gateway_vs_vllm import _commonest_error
from benchmarks.harness import RequestTiming, percentile
from benchmarks.paired import order
from benchmarks.process_table import cpu_share_pct


# --- percentile -----------------------------------------------------------------------------
def test_percentile_single_value_is_that_value() -> None:
    assert percentile([7.0], 0) == 7.0
    assert percentile([7.0], 50) == 7.0
    assert percentile([7.0], 100) == 7.0


def test_percentile_interpolates_between_ranks() -> None:
    # sorted 1, 2, 3, 4: position (n-1)*q = 3*q; p50 -> 1.5 -> 2.5; p90 -> 2.7 -> 3.7
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0


def test_percentile_odd_count_median_is_middle() -> None:
    # sorted 10, 20, 30, 40, 100: p50 at position 2 -> 30; p90 at 3.6 -> 40 + 0.6*60 = 76
    xs = [100.0, 10.0, 40.0, 20.0, 30.0]
    assert percentile(xs, 50) == 30.0
    assert percentile(xs, 90) == pytest.approx(76.0)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


# --- one request --------------------------------------------------------------------------
def test_request_timing_metrics() -> None:
    # sent at 10.0, first content at 10.1, last at 10.5 after 5 tokens, stream ends at 10.6
    t = RequestTiming(sent_s=10.0, done_s=10.6, first_token_s=10.1, last_token_s=10.5, tokens=5)
    assert t.ttft_s == pytest.approx(0.1)
    assert t.tpot_s == pytest.approx(0.1)  # (10.5 - 10.1) / (5 - 1)
    assert t.e2e_s == pytest.approx(0.6)


def test_request_timing_single_token_has_no_tpot() -> None:
    t = RequestTiming(sent_s=0.0, done_s=0.3, first_token_s=0.2, last_token_s=0.2, tokens=1)
    assert t.ttft_s == pytest.approx(0.2)
    assert t.tpot_s is None


def test_failed_request_has_no_metrics() -> None:
    t = RequestTiming(sent_s=0.0, done_s=1.0, first_token_s=0.5, tokens=3, error="boom")
    assert not t.ok
    assert (t.ttft_s, t.tpot_s, t.e2e_s) == (None, None, None)
    assert not RequestTiming(sent_s=0.0, done_s=1.0).ok  # no content ever arrived


# --- a round's figures and the verdict ---------------------------------------------------
def _req(sent: float, ttft: float, tpot: float, tokens: int, tail: float = 0.0) -> RequestTiming:
    first = sent + ttft
    last = first + tpot * (tokens - 1)
    return RequestTiming(
        sent_s=sent, done_s=last + tail, first_token_s=first, last_token_s=last, tokens=tokens
    )


def test_a_rounds_figures_leave_failed_requests_out() -> None:
    failed = RequestTiming(sent_s=0, done_s=1, error="HTTP 500")
    r = RoundResult(
        wall_s=4.0, timings=[_req(0, 0.1, 0.01, 11), _req(1, 0.3, 0.03, 11), _req(0, 0.2, 0.02, 11), failed]
    )
    got = {f.name: f.of(r) for f in FIGURES}
    # TTFTs 100, 200, 300 ms -> p50 200, p90 at position 1.8 -> 280, mean 200
    assert (got["TTFT p50"], got["TTFT p90"], got["TTFT mean"]) == pytest.approx((200.0, 280.0, 200.0))
    assert got["TPOT p50"] == pytest.approx(20.0)
    assert got["E2E mean"] == pytest.approx(400.0)  # e2e = ttft + 10 × tpot: 200, 400, 600 ms
    assert got["throughput"] == pytest.approx(33 / 4)  # 3 good requests × 11 tokens in 4 s
    only_failed = RoundResult(1.0, [failed])
    assert [f.of(only_failed) for f in FIGURES] == [None] * 9 + [0.0]


def test_a_rounds_figures_are_its_latencies_in_ms_and_its_throughput() -> None:
    r = RoundResult(wall_s=2.0, timings=[_req(0, 0.1, 0.01, 11), _req(1, 0.3, 0.03, 11)])
    got = {f.name: f.of(r) for f in FIGURES}
    assert list(got) == [f"{m} {s}" for m in ("TTFT", "TPOT", "E2E") for s in ("p50", "p90", "mean")] + [
        "throughput"
    ]
    assert got["TTFT p50"] == pytest.approx(200.0)  # TTFTs 100 and 300 ms
    assert got["TPOT mean"] == pytest.approx(20.0)
    assert got["E2E p90"] == pytest.approx(560.0)  # e2e 200 and 600 ms: 200 + 0.9 × 400
    assert got["throughput"] == pytest.approx(11.0)  # 22 tokens in 2 s
    assert FIGURES[0].of(RoundResult(1.0, [RequestTiming(sent_s=0, done_s=1, error="x")])) is None


def test_verdict_line_met_and_missed() -> None:
    met = verdict_line(1.15)
    assert met == ("gateway TTFT p50 at concurrency 1 is +15.0% over direct vLLM (target ≤ +20%): met")
    assert verdict_line(1.5).endswith("+50.0% over direct vLLM (target ≤ +20%): MISSED")
    assert "not measured" in verdict_line(None)


# --- plan helpers -------------------------------------------------------------------------
def test_split_requests_and_round_order() -> None:
    assert split_requests(64, 2) == [32, 32]
    assert split_requests(33, 2) == [17, 16]
    assert split_requests(2, 3) == [1, 1, 0]
    with pytest.raises(ValueError):
        split_requests(4, 0)
    assert [order(("a", "b"), r) for r in range(3)] == [("a", "b"), ("b", "a"), ("a", "b")]


def test_parse_concurrency_and_defaults() -> None:
    assert parse_concurrency("1,16") == [1, 16]
    assert parse_concurrency(" 4, 4 ,1,") == [4, 1]
    with pytest.raises(ValueError):
        parse_concurrency("0")
    with pytest.raises(ValueError):
        parse_concurrency(",")
    assert (default_requests(1), default_requests(16), default_requests(32)) == (240, 128, 256)


def test_machine_note_ranges() -> None:
    quiet = {"foreign_omnirelay": 0, "foreign_pytest": 1, "foreign_vllm_engines": 2}
    busy = {"foreign_omnirelay": 8, "foreign_pytest": 1, "foreign_vllm_engines": 2}
    note = machine_note(
        [
            {**quiet, "foreign_cpu_pct": 3.0, "loadavg_1m": 0.5},
            {**busy, "foreign_cpu_pct": 12.4, "loadavg_1m": 3.25},
        ]
    )
    assert note == (
        "machine during the rounds: 0–8 other omnirelay processes, 1 pytest, 2 other vLLM engines; "
        "other processes used 3–12% of a core; load average 0.5–3.2"
    )
    assert "? other omnirelay processes" in machine_note([])


def test_machine_note_flags_rounds_that_shared_the_machine() -> None:
    note = machine_note([{"foreign_cpu_pct": 5.0}, {"foreign_cpu_pct": 60.0}, {"foreign_cpu_pct": 25.0}])
    assert note.endswith("(2 of 3 rounds shared the machine: expect noisy numbers)")
    assert "noisy" not in machine_note([{"foreign_cpu_pct": 19.0}])


def test_cpu_share_pct() -> None:
    before = {1: 10.0, 2: 5.0, 3: 1.0}  # pid 3 exits during the round
    after = {1: 10.5, 2: 5.25, 4: 0.25}  # pid 4 is born during the round
    # (0.5 + 0.25 + 0.25) CPU seconds over 2 s of wall time = 50% of one core
    assert cpu_share_pct(before, after, 2.0) == pytest.approx(50.0)
    assert cpu_share_pct(before, after, 0.0) == 0.0


def test_late_first_token_share() -> None:
    streamed = RequestTiming(sent_s=0, done_s=1.0, first_token_s=0.1, last_token_s=0.95, tokens=10)
    burst = RequestTiming(sent_s=0, done_s=1.0, first_token_s=0.95, last_token_s=0.99, tokens=10)
    one_token = RequestTiming(sent_s=0, done_s=1.0, first_token_s=0.99, last_token_s=0.99, tokens=1)
    failed = RequestTiming(sent_s=0, done_s=1.0, error="x")
    assert late_first_token_share([streamed, burst, one_token, failed]) == pytest.approx(0.5)
    assert late_first_token_share([one_token, failed]) is None


def test_verdict_line_flags_unreliable() -> None:
    line = verdict_line(1.1, unreliable="burst-delivered streams")
    assert line.endswith("(target ≤ +20%): met — UNRELIABLE: burst-delivered streams")


def test_the_commonest_error_is_named_with_its_count() -> None:
    timings = [
        RequestTiming(sent_s=0, done_s=1.0, error="HTTP 503: no live replica"),
        RequestTiming(sent_s=0, done_s=1.0),
        RequestTiming(sent_s=0, done_s=1.0, error="timeout"),
        RequestTiming(sent_s=0, done_s=1.0, error="HTTP 503: no live replica"),
    ]
    assert _commonest_error(timings) == "HTTP 503: no live replica (×2)"
