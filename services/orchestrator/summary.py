"""Log lines of the orchestrator (with --log-stats): one summary per finished request and a
periodic pipeline line. Pure formatting over records and counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from libs.common.pipeline import PipelineConfig
from libs.common.records import RequestRecord, RequestStatus


def ready_to_summarize(rec: RequestRecord) -> bool:
    """Terminal and, when completed, every stage has reported done (its transfers are in)."""
    if not rec.status.terminal or rec.summary_logged:
        return False
    return rec.status != RequestStatus.COMPLETED or all(s.done_ns for s in rec.stages)


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def format_summary(rec: RequestRecord, pipeline: PipelineConfig) -> str:
    """``request <id> <status> e2e <s> | stage times | edge transfers``. Stage time: the stage's
    first input taken → its last output sent (worker clock); e2e: gateway arrival → the last
    stage's done (wall clocks)."""
    done = [s.done_ns for s in rec.stages if s.done_ns]
    e2e = f"{(max(done) - rec.arrival_ns) / 1e9:.3f} s" if done else "-"
    stages = []
    for i, s in enumerate(rec.stages):
        if i < rec.entry_stage:
            stages.append(f"{pipeline.stages[i].name} skipped")
            continue
        took = f"{(s.done_ns - s.started_ns) / 1e9:.3f} s" if s.started_ns and s.done_ns else "-"
        stages.append(f"{pipeline.stages[i].name}#{s.replica} {took}")
    edges = [
        f"{e.from_stage}/{e.from_replica}→{e.to_stage}/{e.to_replica} {_bytes(e.bytes)} ×{e.hops} "
        f"tx {e.tx_s * 1e3:.2f} ms in-flight {e.in_flight_s * 1e3:.2f} ms rx {e.rx_s * 1e3:.2f} ms"
        for e in sorted(rec.edges, key=lambda e: (e.to_stage, e.from_stage))
    ]
    status = rec.status.value + (f" ({rec.finish_reason})" if rec.finish_reason else "")
    status += f" [{rec.error}]" if rec.error else ""
    return f"request {rec.request_id} {status} e2e {e2e} | {', '.join(stages)} | {'; '.join(edges) or 'no transfers'}"


@dataclass
class PipelineTally:
    """What this orchestrator instance handled since start, for the periodic pipeline line."""

    admitted: int = 0
    ended: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    _last: tuple[int, int] = (0, 0)

    def end(self, rec: RequestRecord) -> None:
        self.ended[rec.status.value] += 1
        if rec.status == RequestStatus.FAILED:
            self.failures[rec.error or "unknown"] += 1

    def line(self, pipeline: str, inflight: int, period_s: float) -> str:
        """``pipeline <p>: x admissions/s, y completions/s; in flight n; totals ...``; rates over
        the time since the previous line."""
        done = sum(self.ended.values())
        rate_in = (self.admitted - self._last[0]) / period_s
        rate_out = (done - self._last[1]) / period_s
        self._last = (self.admitted, done)
        fails = ", ".join(f"{k} {v}" for k, v in sorted(self.failures.items()))
        return (
            f"pipeline {pipeline}: {rate_in:.1f} admissions/s, {rate_out:.1f} completions/s; in flight {inflight}; "
            f"totals: admitted {self.admitted}, completed {self.ended['completed']}, "
            f"failed {self.ended['failed']}{f' ({fails})' if fails else ''}, aborted {self.ended['aborted']}"
        )
