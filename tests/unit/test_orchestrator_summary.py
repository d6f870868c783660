"""The orchestrator's per-request summary and periodic pipeline line."""

from __future__ import annotations

from libs.common.envelopes import EdgeSummary
from libs.common.pipeline import load_pipeline
from libs.common.records import RequestRecord, RequestStatus, StageProgress
from services.orchestrator.summary import PipelineTally, format_summary, ready_to_summarize

S = 10**9


def _rec(status: RequestStatus, done: bool = True) -> RequestRecord:
    return RequestRecord(
        request_id="r1",
        pipeline="omni",
        gateway_id="g",
        status=status,
        route=[-1, 1, 0, 0],
        entry_stage=1,
        stages=[
            StageProgress(replica=-1, done_ns=S),  # the listener: a chat request skips it (done at admission)
            StageProgress(replica=1, started_ns=1 * S, done_ns=2 * S),
            StageProgress(replica=0, started_ns=1 * S + S // 2, done_ns=3 * S),
            StageProgress(replica=0, started_ns=2 * S, done_ns=4 * S if done else None),
        ],
        arrival_ns=S // 2,
        admitted_ns=S,
        deadline_ns=100 * S,
        updated_ns=4 * S,
        finish_reason="length",
        edges=[
            EdgeSummary(
                from_stage="1",
                from_replica="1",
                to_stage="2",
                to_replica="0",
                hops=3,
                bytes=2048,
                tx_s=0.003,
                rx_s=0.0015,
                in_flight_s=0.006,
            )
        ],
    )


def test_summary_has_stage_times_edges_and_e2e() -> None:
    line = format_summary(_rec(RequestStatus.COMPLETED), load_pipeline())
    assert line.startswith("request r1 completed (length) e2e 3.500 s | ")
    assert "listener skipped, thinker#1 1.000 s, talker#0 1.500 s, code2wav#0 2.000 s" in line
    assert "1/1→2/0 2.0 KiB ×3 tx 3.00 ms in-flight 6.00 ms rx 1.50 ms" in line


def test_a_completed_request_waits_for_every_stage_and_is_summarized_once() -> None:
    assert not ready_to_summarize(_rec(RequestStatus.COMPLETED, done=False))
    assert not ready_to_summarize(_rec(RequestStatus.RUNNING))
    assert ready_to_summarize(_rec(RequestStatus.FAILED, done=False))
    rec = _rec(RequestStatus.COMPLETED)
    assert ready_to_summarize(rec)
    rec.summary_logged = True
    assert not ready_to_summarize(rec)


def test_pipeline_line_rates_and_totals() -> None:
    t = PipelineTally()
    t.admitted = 10
    for status in (RequestStatus.COMPLETED,) * 7 + (RequestStatus.ABORTED,):
        t.end(_rec(status))
    failed = _rec(RequestStatus.FAILED)
    failed.error = "timeout"
    t.end(failed)
    assert t.line("omni", 1, 5.0) == (
        "pipeline omni: 2.0 admissions/s, 1.8 completions/s; in flight 1; "
        "totals: admitted 10, completed 7, failed 1 (timeout 1), aborted 1"
    )
    assert t.line("omni", 0, 5.0).startswith("pipeline omni: 0.0 admissions/s, 0.0 completions/s")
