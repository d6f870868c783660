"""The statistics of ``omnirelay bench vllm`` (benchmarks/vllm_client_paired.py) and of
``omnirelay bench capacity`` (benchmarks/frontend_capacity.py), on hand-made results whose answers
are worked out here; and vLLM's own client's command line, parsed by vLLM's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.comparison_stats import DIRECT, GATEWAY
from benchmarks.frontend_capacity import _role, bottleneck, cell_result, stack_env
from benchmarks.frontend_capacity import render as render_capacity
from benchmarks.harness import RequestTiming, Target
from benchmarks.paired import Paired, Run
from benchmarks.vllm_client_paired import (
    FIGURES,
    ClientRun,
    VllmClientOptions,
    burst_notes,
    client_argv,
    default_prompts,
    report,
    run_from_result,
)


def _run(
    target: str, c: int, r: int, tpot: float, ttft: float, tput: float, failed: int = 0
) -> Run[ClientRun]:
    figures = {"median_tpot_ms": tpot, "median_ttft_ms": ttft, "output_throughput": tput}
    return Run(target, f"c={c}", r, ClientRun(figures, 10 - failed, failed))


def _paired(*runs: Run[ClientRun]) -> Paired[ClientRun]:
    return Paired((GATEWAY, DIRECT), DIRECT, ("c=1", "c=16"), list(runs))


PAIRED = _paired(
    _run(GATEWAY, 1, 0, 2.0, 10.0, 400.0),
    _run(DIRECT, 1, 0, 1.6, 9.0, 500.0),
    _run(DIRECT, 1, 1, 1.5, 8.0, 520.0),
    _run(GATEWAY, 1, 1, 1.8, 8.5, 480.0),
    _run(GATEWAY, 1, 2, 1.6, 9.5, 450.0),
    _run(DIRECT, 1, 2, 1.6, 9.0, 450.0),
    _run(GATEWAY, 16, 0, 3.0, 30.0, 3000.0),  # no vLLM run in round 0 at c=16: unpaired
    _run(GATEWAY, 16, 1, 3.0, 30.0, 3000.0),
    _run(DIRECT, 16, 1, 2.0, 20.0, 2500.0, failed=2),
)
TPOT, TTFT, THROUGHPUT = FIGURES[:3]
TTFT_DIFFERENCE = FIGURES[-1]


def test_rounds_pair_only_when_both_targets_ran() -> None:
    assert PAIRED.per_round(TPOT, GATEWAY, "c=16") == [1.5]
    assert len(PAIRED.per_round(TPOT, GATEWAY, "c=1")) == 3


def test_per_round_ratios_and_their_median_and_range() -> None:
    ratios = PAIRED.per_round(TPOT, GATEWAY, "c=1")
    assert ratios == pytest.approx([2.0 / 1.6, 1.8 / 1.5, 1.0])
    s = PAIRED.compared(TPOT, GATEWAY, "c=1")
    assert s is not None
    assert s.median == pytest.approx(1.2)
    assert (s.low, s.high) == pytest.approx((1.0, 1.25))
    assert PAIRED.per_round(THROUGHPUT, GATEWAY, "c=16") == pytest.approx([1.2])


def test_ttft_differences_in_ms() -> None:
    assert PAIRED.per_round(TTFT_DIFFERENCE, GATEWAY, "c=1") == pytest.approx([1.0, 0.5, 0.5])


def test_a_zero_baseline_gives_no_ratio() -> None:
    paired = _paired(_run(GATEWAY, 1, 0, 1.0, 1.0, 1.0), _run(DIRECT, 1, 0, 0.0, 1.0, 1.0))
    assert paired.per_round(TPOT, GATEWAY, "c=1") == []
    assert paired.compared(TPOT, GATEWAY, "c=1") is None


def test_the_report_shows_medians_spreads_and_failures() -> None:
    text = report(PAIRED)
    line = next(x for x in text.splitlines() if x.startswith("TPOT p50 (ms)") and " c=1 " in x)
    assert line.split()[4:7] == ["1.80", "1.60", "1.20x"]  # omnirelay's and vLLM's medians, the ratio's
    assert "1.00x–1.25x" in line and "1.25x, 1.20x, 1.00x" in line
    line = next(x for x in text.splitlines() if x.startswith("TTFT p50 difference (ms)") and " c=1 " in x)
    assert "+0.50" in line.split() and "+0.50–+1.00" in line
    assert "vLLM c=16 round 1: 2 failed requests" in text


def test_a_stream_that_came_in_one_burst_is_flagged() -> None:
    fine = Run(DIRECT, "c=16", 0, ClientRun({"median_ttft_ms": 20.0, "median_e2el_ms": 160.0}, 10, 0))
    burst = Run(DIRECT, "c=1", 1, ClientRun({"median_ttft_ms": 141.0, "median_e2el_ms": 142.0}, 10, 0))
    unknown = Run(GATEWAY, "c=1", 1, ClientRun({"median_ttft_ms": 141.0}, 10, 0))
    assert (fine.result.burst, burst.result.burst, unknown.result.burst) == (False, True, False)
    (note,) = burst_notes(_paired(fine, burst, unknown))
    assert note.startswith("WARNING: vLLM c=1: streams came in one burst") and "rounds 1" in note
    assert note in report(_paired(fine, burst, unknown))


def test_a_result_file_becomes_a_run() -> None:
    result = {
        "completed": 46,
        "failed": 2,
        "num_prompts": 48,
        "median_tpot_ms": 1.5,
        "median_ttft_ms": 7.0,
        "output_throughput": 600.5,
        "mean_tpot_ms": 9.9,
        "median_e2el_ms": 100.0,
    }
    run = run_from_result(result)
    assert run.figures == {
        "median_tpot_ms": 1.5,
        "median_ttft_ms": 7.0,
        "output_throughput": 600.5,
        "median_e2el_ms": 100.0,
    }
    assert (run.completed, run.failed) == (46, 2)
    assert run_from_result({"completed": 40, "num_prompts": 48}).failed == 8


def test_default_prompts() -> None:
    assert default_prompts(1) == 48
    assert default_prompts(16) == 256


def test_the_client_command_line_is_one_vllms_parser_accepts(tmp_path: Path) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    target = Target("omnirelay", "http://127.0.0.1:8123/v1", "omni-text", None)  # type: ignore[arg-type]
    argv = client_argv(target, "/models/tiny", VllmClientOptions(), 16, seed=3, out=tmp_path / "r.json")
    assert argv[1:3] == ["-m", "benchmarks.vllm_bench_client"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv[3:])
    assert args.base_url == "http://127.0.0.1:8123"
    assert (args.backend, args.endpoint, args.dataset_name) == (
        "openai-chat",
        "/v1/chat/completions",
        "random",
    )
    assert (args.random_input_len, args.random_output_len, args.max_concurrency) == (48, 64, 16)
    assert args.ignore_eos and args.save_result and args.seed == 3 and args.num_prompts == 256
    assert Path(args.result_dir) / args.result_filename == tmp_path / "r.json"
    assert args.served_model_name == "omni-text"
    assert "e2el" in args.percentile_metrics.split(",")


# --- bench capacity ---------------------------------------------------------------------------------


def _timing(sent: float, first: float, last: float, done: float, tokens: int, error: str | None = None):
    return RequestTiming(sent, done, first, last, tokens, 10, tokens, error)


def test_a_capacity_cell_from_its_timings() -> None:
    timings = [
        _timing(0.0, 0.010, 0.073, 0.080, 64),
        _timing(0.5, 0.530, 0.593, 0.600, 64),
        _timing(1.0, 1.020, 1.083, 2.000, 64),
        RequestTiming(1.5, 1.6, error="APIError: 503"),
    ]
    cell = cell_result(2, 64, timings, {"gateway-1": 50.0}, 2)
    assert cell.wall_s == pytest.approx(2.0)
    assert (cell.requests, cell.errors) == (4, 1)
    assert cell.req_per_s == pytest.approx(1.5)
    assert cell.tokens_per_s == pytest.approx(96.0)
    assert cell.ttft_ms is not None and cell.ttft_ms[0] == pytest.approx(20.0)
    assert cell.tpot_ms is not None and cell.tpot_ms[0] == pytest.approx(1.0)
    assert cell.error_sample == "APIError: 503"
    text = render_capacity([cell])
    assert "gateway-1" in text and "1 failed, e.g. APIError: 503" in text


@pytest.mark.parametrize(
    ("cpu", "cores", "want"),
    [
        ({"gateway-1": 97.0, "worker": 60.0, "nats": 20.0}, 4, "gateway-1 (97% of a core)"),
        (
            {"gateway-1": 70.0, "worker": 80.0, "nats": 40.0, "clients (2)": 60.0},
            2,
            "the machine: 250% of 2 cores",
        ),
        ({"gateway-1": 40.0, "clients (2)": 95.0}, 4, "the load generator: clients (2) 95%"),
        ({"gateway-1": 30.0, "worker": 20.0}, 2, "no process saturated (busiest gateway-1 30%"),
        ({}, 2, "unknown"),
        (
            {"others": 150.0, "gateway-1": 40.0},
            2,
            "the machine: 190% of 2 cores busy, most in gateway-1 (40%), 150% by other",
        ),
        ({"others": 99.0, "worker": 50.0}, 4, "no process saturated (busiest worker 50%"),
    ],
)
def test_the_bottleneck_rule(cpu: dict[str, float], cores: int, want: str) -> None:
    assert bottleneck(cpu, cores).startswith(want)


def test_processes_are_named_by_their_command_line() -> None:
    assert _role("/venv/bin/nats-server -js -sd /tmp/x -p 4222") == "nats"
    assert _role("/venv/bin/python -m cli gateway") == "gateway"
    assert _role("/venv/bin/python -m cli worker") == "worker"
    assert _role("/venv/bin/python -m cli up --pipeline p.yaml --port 1") == "up"


def test_the_stack_takes_the_highest_concurrency_at_once() -> None:
    assert stack_env((64, 256)) == {"OMNIRELAY_MAX_INFLIGHT": "256", "OMNIRELAY_MAX_CONCURRENT_PER_KEY": "0"}
    assert stack_env((16,))["OMNIRELAY_MAX_INFLIGHT"] == "128"  # never below the default
