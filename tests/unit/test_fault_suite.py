"""The fault suite's accounting: a row from what the clients saw (pure)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.fault_suite import Fault, Seen, render, row_of, verdicts_since


def test_a_row_counts_completed_failed_hung_and_wrong_counts_and_the_longest_pause() -> None:
    fault = Fault("kill -9 a thinker replica", "worker", 0, streams=5, max_tokens=3)
    full = Seen(token_ids=[1, 2, 3], at=[1.0, 2.0, 5.5], usage_tokens=3, ended_s=6.0)
    before_only = Seen(token_ids=[1, 2, 3], at=[0.5, 1.0, 1.5], usage_tokens=3, ended_s=1.6)
    repeated = Seen(token_ids=[1, 2, 2, 3], at=[1.0, 4.0], usage_tokens=4, ended_s=4.5)
    failed = Seen(error="replica_lost", ended_s=3.0)
    hung = Seen(token_ids=[1], at=[1.0])
    row = row_of(fault, "pid 7 gone", 3.0, [full, before_only, repeated, failed, hung], reference=[1, 2, 4])
    assert (row.in_flight, row.completed, row.failed, row.hung, row.wrong_count) == (
        5,
        3,
        {"replica_lost": 1},
        1,
        1,
    )
    assert row.pause_s == 3.5  # full: 2.0 -> 5.5 spans the fault; before_only never paused after it
    assert row.unlike_reference == 3
    table = render([row])
    assert row.error_s == 0.0  # the failed stream ended at the fault
    assert (
        "| kill -9 a thinker replica | pid 7 gone | 5 | 3 | 1 replica_lost | 1 | 1 | 3 | 3.50 | - | 0.00 | - |"
        in table
    )


def test_the_time_to_an_error_is_the_longest_from_the_fault_to_a_failed_streams_end() -> None:
    fault = Fault("kill -9 every thinker replica", "all_replicas", 0, streams=3, max_tokens=3)
    early = Seen(error="no_live_replica", ended_s=12.5)
    late = Seen(error="no_live_replica", ended_s=14.0)
    done = Seen(token_ids=[1, 2, 3], at=[9.0], usage_tokens=3, ended_s=10.5)
    row = row_of(fault, "pids gone", 10.0, [early, late, done])
    assert (row.failed, row.error_s, row.replaced_s) == ({"no_live_replica": 2}, 4.0, None)


def test_audio_faults_report_the_audio_lengths() -> None:
    fault = Fault("kill -9 a code2wav replica", "worker", 2, streams=2, audio=True, max_tokens=1)
    a = Seen(token_ids=[1], at=[1.0], usage_tokens=1, audio_bytes=48_000, ended_s=2.0)
    b = Seen(token_ids=[1], at=[1.0], usage_tokens=1, audio_bytes=96_000, ended_s=2.0)
    assert row_of(fault, "pid 9 gone", 0.5, [a, b]).audio_s == (1.0, 2.0)


def test_verdicts_are_counted_from_the_orchestrators_log_lines_after_the_fault(tmp_path: Path) -> None:
    log = tmp_path / "stack.log"
    before = (
        "orchestrator | stage 0 (thinker) replica 1 is dead (exit: no responders for 0.0 s); 2 request(s)\n"
    )
    after = (
        "orchestrator | stage 0 (thinker) replica 0 is dead (exit: no responders for 1.0 s); 3 request(s)\n"
        "orchestrator | request r1 moved: stage 0 replica 0 -> 1 (attempt 2, exit, decode; ...)\n"
        "thinker-1    | request r2 moved to another replica; stopping it here\n"
        "orchestrator | request r2 moved: stage 0 replica 0 -> 1 (attempt 2, exit, decode; ...)\n"
    )
    log.write_text(before + after)
    assert verdicts_since(log, len(before.encode())) == (1, 2)
    assert verdicts_since(log, 0) == (2, 2)
