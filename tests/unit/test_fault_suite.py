"""The fault suite's accounting (a row from what the clients saw), and what its ``services`` mode
adds: the restart policy's back-off, the victim lookup, and a real process under the policy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.chat_streams import TWO_REPLICA_PIPELINE, Seen
from libs.common.pipeline import load_pipeline
from libs.stack.process_plan import plan_services
from tests.verification.audio_accounting import AudioTally
from tests.verification.fault_injection import (
    FAULTS,
    REPLICAS,
    Fault,
    matches,
    verdicts_since,
    victim_service,
)
from tests.verification.fault_sessions import SAMPLES_PER_TOKEN
from tests.verification.fault_suite import (
    NO_LIVE_REPLICA,
    Row,
    bound_in_stage,
    busiest,
    passed,
    render,
    replaced_by_a_new_process,
    row_of,
)


def test_a_row_counts_completed_failed_hung_and_wrong_counts_and_the_longest_pause() -> None:
    fault = Fault("kill -9 a thinker replica", "worker", 0, streams=5, max_tokens=3)
    full = Seen(token_ids=[1, 2, 3], at=[1.0, 2.0, 5.5], usage_tokens=3, ended_s=6.0)
    before_only = Seen(token_ids=[1, 2, 3], at=[0.5, 1.0, 1.5], usage_tokens=3, ended_s=1.6)
    repeated = Seen(token_ids=[1, 2, 2, 3], at=[1.0, 4.0], usage_tokens=4, ended_s=4.5)
    failed = Seen(error="replica_lost", ended_s=3.0)
    hung = Seen(token_ids=[1], at=[1.0])
    row = row_of(
        fault, "pid 7 gone", 3.0, [full, before_only, repeated, failed, hung], Seen(token_ids=[1, 2, 4])
    )
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


def test_a_session_is_whole_when_its_audio_is_its_tokens_spoken_once_and_like_when_heard_alike() -> None:
    fault = Fault(
        "kill -9 a listener replica", "worker", 0, streams=3, audio=True, max_tokens=40, session=True
    )
    per_token = 2 * SAMPLES_PER_TOKEN
    whole = Seen(heard="Hello there.", usage_tokens=30, audio_bytes=30 * per_token, at=[1.0], ended_s=2.0)
    short = Seen(heard="Hello there.", usage_tokens=30, audio_bytes=29 * per_token, at=[1.0], ended_s=2.0)
    twice = Seen(heard="Hello there. Hello there.", usage_tokens=8, audio_bytes=8 * per_token, ended_s=2.0)
    row = row_of(fault, "pid 3 gone", 0.5, [whole, short, twice], Seen(heard="Hello there."))
    assert (row.completed, row.wrong_count, row.unlike_reference) == (3, 1, 1)


def test_verdicts_are_counted_from_the_orchestrators_log_lines_after_the_fault(tmp_path: Path) -> None:
    log = tmp_path / "stack.log"
    before = (
        "orchestrator | stage 1 (talker) replica 1 is dead (exit: no responders for 0.0 s); 2 request(s)\n"
    )
    after = (
        "orchestrator | stage 0 (thinker) replica 0 is dead (exit: no responders for 1.0 s); 3 request(s)\n"
        "orchestrator | request r1 moved: stage 0 replica 0 -> 1 (attempt 2, exit, decode; ...)\n"
        "thinker-1    | request r2 moved to another replica; stopping it here\n"
        "orchestrator | request r2 moved: stage 0 replica 0 -> 1 (attempt 2, exit, decode; ...)\n"
        # the same replica judged again (a stall, then its exit): still one replica
        "orchestrator | stage 0 (thinker) replica 0 is dead (stall: no answer to its probe for 10.5 s); 1\n"
        # the stage had no live replica left: no eviction line, a failed request names the replica
        "orchestrator | request r3 failed: stage 0 (thinker) replica 1 died (exit) and the stage has no live"
        " replica to move the request to\n"
        "orchestrator | request r4 failed: stage 0 (thinker) replica 1 died (exit) and the stage has no live"
        " replica to move the request to\n"
    )
    log.write_text(before + after)
    assert verdicts_since(log, len(before.encode())) == (2, 2)
    assert verdicts_since(log, 0) == (3, 2)


def test_the_victim_lookup_finds_the_one_worker_of_a_stage_and_replica() -> None:
    """A worker's EngineCore has a title of its own; another replica and another stage differ in
    their names, one of which begins with the other."""
    py = "/venv/bin/python -m cli"
    table = {
        10: f"{py} orchestrator [orchestrator]",
        11: f"{py} worker [thinker-0]",
        12: f"{py} worker [thinker-1]",
        13: "VLLM::EngineCore",
        14: f"{py} worker [talker-1]",
        15: f"{py} worker [thinker-10]",
    }
    assert [pid for pid, cmd in table.items() if matches(cmd, ("-m cli worker", "[thinker-1]"))] == [12]
    assert [pid for pid, cmd in table.items() if matches(cmd, ("-m cli worker", "[talker-1]"))] == [14]
    assert [pid for pid, cmd in table.items() if matches(cmd, ("-m cli orchestrator",))] == [10]


def test_every_fault_of_one_service_names_a_service_of_the_process_plan(tmp_path: Path) -> None:
    """The name a fault's victim is looked up by in the services mode is one the process plan
    (which the compose file and ``omnirelay up`` follow) gives a process, or the NATS server's."""
    pipeline_path = tmp_path / "faults.yaml"
    pipeline_path.write_text(TWO_REPLICA_PIPELINE)
    planned = {
        s.name for s in plan_services(load_pipeline(pipeline_path), pipeline_path, "nats://x", 1, True)
    }
    single = [f for f in FAULTS if f.target in ("worker", "engine_core", "orchestrator", "nats")]
    assert len(single) == 9
    names = {victim_service(f, r) for f in single for r in range(REPLICAS)}
    assert names == {"thinker-0", "thinker-1", "talker-0", "talker-1", "code2wav-0", "code2wav-1"} | {
        "orchestrator",
        "nats",
    }
    assert names - {"nats"} <= planned
    with pytest.raises(ValueError):
        victim_service(next(f for f in FAULTS if f.target == "all_replicas"), 0)


def test_a_row_waits_for_a_replacement_exactly_after_the_faults_that_end_a_process() -> None:
    waits = {f.name for f in FAULTS if replaced_by_a_new_process(f)}
    assert waits == {
        "kill -9 a thinker replica",
        "kill -9 a talker replica",
        "kill -9 a code2wav replica",
        "kill -9 a thinker's EngineCore only",
        "SIGSTOP a thinker's EngineCore 30 s (a hung engine)",  # its worker gives up on it and exits
        "kill -9 every thinker replica (down while their engines start)",
        "kill -9 the orchestrator",
    }


def _record(rid: str, status: str, route: list[int], done: list[bool]) -> dict:
    """A request record as the orchestrator stores it (the fields the strike reads)."""
    stages = [
        {"replica": r, "done_ns": 5 if d else None, "attempts": []} for r, d in zip(route, done, strict=False)
    ]
    return {"request_id": rid, "status": status, "route": route, "stages": stages}


def test_a_fault_strikes_the_replica_most_streams_still_run_on_at_the_server() -> None:
    """The client may read far behind the server: a stream it still reads may be over on the
    server (completed) or past the fault's stage (done there); neither counts as under way."""
    records = [
        _record("a", "running", [0, 1], [False, False]),
        _record("b", "running", [1, 1], [False, False]),
        _record("c", "running", [1, 0], [False, False]),
        _record("d", "completed", [1, 1], [True, True]),  # the client still reads its tokens
        _record("e", "running", [1, 0], [True, False]),  # stage 0 done, in the talker now
        _record("f", "admitted", [0, 0], []),  # bound, not started anywhere yet
    ]
    assert bound_in_stage(records, 0) == {"a": 0, "b": 1, "c": 1, "f": 0}
    assert bound_in_stage(records, 1) == {"a": 1, "b": 1, "c": 0, "e": 0, "f": 0}
    assert busiest(bound_in_stage(records, 1)) == (0, 3)
    assert busiest({"a": 0, "b": 1, "c": 1, "f": 0}) == (0, 2)  # a tie: the lowest replica
    assert busiest({"b": 1, "c": 1, "f": 0}) == (1, 2)


def _row(**changes) -> Row:
    clean = Row("f", "pid 7 gone", 4, 4, {}, 0, 0, 0, 0.5)
    return replace(clean, **changes)


def test_a_row_passes_only_when_every_stream_came_through_whole() -> None:
    kill = Fault("kill -9 a thinker replica", "worker", 0, streams=4)
    assert passed(kill, _row())
    assert passed(kill, _row(unlike_reference=None))  # no reference taken
    assert not passed(kill, _row(completed=3, failed={"replica_lost": 1}))
    assert not passed(kill, _row(completed=3, hung=1))
    assert not passed(kill, _row(wrong_count=1))
    assert not passed(kill, _row(unlike_reference=1))
    assert not passed(kill, _row(struck=False))  # the streams ended before the fault
    tally = AudioTally(
        streams=4,
        whole=4,
        expected=40,
        missing=0,
        repeated=0,
        unlike=0,
        input_unlike=0,
        resent=0,
        resent_unlike=0,
        gaps=0,
    )
    assert passed(kill, _row(chunks=tally))
    assert not passed(kill, _row(chunks=replace(tally, whole=3, missing=1)))
    assert not passed(kill, _row(chunks=replace(tally, whole=3, repeated=2)))


def test_every_replica_down_passes_when_every_stream_is_told_so() -> None:
    down = Fault("kill -9 every thinker replica", "all_replicas", 0, streams=4)
    assert passed(down, _row(completed=0, failed={NO_LIVE_REPLICA: 4}))
    assert not passed(down, _row())  # the fault struck nothing
    assert not passed(down, _row(completed=0, failed={NO_LIVE_REPLICA: 3, "timeout": 1}))
