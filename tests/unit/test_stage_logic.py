"""Pure pieces of the workers and orchestrator: chunking, re-ordering, routing, record updates."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from nats.errors import NoRespondersError

from libs.common.envelopes import (
    MOVED,
    AbortNotice,
    ClientEvent,
    ClientEventType,
    EdgeSummary,
    LifecycleEvent,
    ResumePoint,
    ResumeQuery,
    RouteNotice,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.pipeline import load_pipeline
from libs.common.records import RequestRecord, RequestStatus, StageProgress
from libs.common.registry import LiveServices, ServiceKind, ServiceRecord
from libs.common.settings import WorkerSettings
from libs.common.text_chunks import TextChunker
from services.orchestrator.lifecycle import apply_event
from services.orchestrator.routing import NoLiveReplica, ReplicaPicker
from services.stage_worker import client_stream, request_context, request_table
from services.stage_worker.chunking import CodeChunker
from services.stage_worker.client_stream import ClientStream
from services.stage_worker.control import reroute
from services.stage_worker.inbox import Delivery, RequestInbox
from services.stage_worker.request_context import Identity, RequestContext
from services.stage_worker.request_table import Phase, RequestTable, Verdict
from services.stage_worker.worker import StageWorker


def test_text_chunker_cuts_by_count_and_at_sentence_ends() -> None:
    c = TextChunker(max_tokens=3, sentence_end=True)
    assert c.feed([1], "Hi") == []
    assert [(x.token_ids, x.text) for x in c.feed([2], " there.")] == [([1, 2], "Hi there.")]
    assert c.feed([3], " a") == [] and c.feed([4], " b") == []
    assert [x.token_ids for x in c.feed([5], " c")] == [[3, 4, 5]]
    assert c.feed([6], "!") and c.flush().token_ids == []


def test_text_chunker_without_sentence_ends_and_flush() -> None:
    c = TextChunker(max_tokens=4, sentence_end=False)
    assert c.feed([1, 2], "a.") == []
    rest = c.flush()
    assert (rest.token_ids, rest.text) == ([1, 2], "a.")


def test_code_chunker_emits_fixed_size_chunks_numbered_by_position() -> None:
    c = CodeChunker(size=3)
    assert c.feed([1, 2]) == [] and c.sent_upto == 0
    assert c.feed([3, 4, 5, 6, 7]) == [(0, [1, 2, 3]), (1, [4, 5, 6])]
    assert c.sent_upto == 6
    assert c.flush() == (2, [7])


def test_text_chunks_know_where_they_start() -> None:
    c = TextChunker(max_tokens=2, sentence_end=False)
    chunks = [*c.feed([1, 2, 3], "abc"), c.flush()]
    assert [(ch.token_ids, ch.offset) for ch in chunks] == [([1, 2], 0), ([3], 2)]


def test_a_code_chunker_taking_over_mid_stream_cuts_the_same_chunks_with_the_same_numbers() -> None:
    """A talker that dies after acknowledging text chunks whose codes are all sent: its successor
    starts at the oldest unacknowledged text chunk's first code (position 7 here) and reproduces
    the rest of the chunks exactly, dropping the codes of the chunk already sent across the seam."""
    codes = list(range(100, 120))
    whole = CodeChunker(size=3)
    reference = whole.feed(codes[:7]) + whole.feed(codes[7:]) + [whole.flush()]
    successor = CodeChunker(size=3, start=7)
    assert successor.next_seq == 3 and successor.sent_upto == 9  # chunk 2 (codes 6-8) went out
    resumed = successor.feed(codes[7:8]) + successor.feed(codes[8:]) + [successor.flush()]
    assert resumed == reference[3:]
    aligned = CodeChunker(size=3, start=6)
    assert [*aligned.feed(codes[6:]), aligned.flush()] == reference[2:]


def _delivery(seq: int) -> Delivery:
    t = StageTask(
        request_id="r", gateway_id="g", arrival_ns=0, deadline_ns=0, route=[0], kind=TaskKind.CHUNK, seq=seq
    )
    return Delivery(msg=None, task=t, received_ns=0)


async def test_inbox_hands_out_in_sequence_and_rejects_duplicates() -> None:
    box = RequestInbox()
    assert box.put(_delivery(2)) and box.put(_delivery(1))
    assert not box.put(_delivery(2))
    waiter = asyncio.create_task(box.next())
    await asyncio.sleep(0.01)  # the waiter runs and waits: time passes in which it must not finish
    assert not waiter.done()  # seq 0 has not arrived
    assert box.put(_delivery(0))
    assert (await waiter).task.seq == 0
    assert [(await box.next()).task.seq for _ in range(2)] == [1, 2]
    assert not box.put(_delivery(1)) and box.held() == []


async def test_an_abort_stops_the_handler_even_when_its_cancellation_is_lost() -> None:
    """A cancellation that arrives together with a publish ack is dropped by Python 3.11's
    ``asyncio.wait_for`` (nats-py awaits acks with it); the request must stop at its next step."""
    ctx = RequestContext(Identity(1, 0), bus=None, first=_delivery(0).task)
    ack = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def handler() -> None:
        await asyncio.wait_for(ack, 5)  # the "publish" whose ack and the cancellation coincide
        steps.append("went on")
        ctx.inbox.put(_delivery(0))
        await ctx.next()
        steps.append("took more input")

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)  # the handler waits for its ack
    ack.set_result("ack")
    ctx.abort("client disconnected")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "took more input" not in steps


class FakeLive:
    """The part of LiveServices the picker uses."""

    def __init__(self, loads: dict[int, int]) -> None:
        self.records = [
            ServiceRecord(
                service=ServiceKind.WORKER, pipeline="p", instance=f"i{r}", stage=0, replica=r, load=n
            )
            for r, n in loads.items()
        ]
        self.listeners = []

    def on_update(self, fn) -> None:
        self.listeners.append(fn)

    def live(self, service=None, stage=None):
        return [r for r in self.records if stage in (None, r.stage)]

    def last_heard(self, service, stage=None):
        return [(r, 1.5) for r in self.records if stage in (None, r.stage)]


def test_picker_prefers_least_loaded_and_counts_its_own_bindings() -> None:
    live = FakeLive({0: 3, 1: 0})
    picker = ReplicaPicker(live)
    picks = [picker.pick(0) for _ in range(5)]
    # replica 1 starts 3 lower; after 3 bindings both are equal and they alternate.
    assert picks[:3] == [1, 1, 1] and sorted(picks[3:]) == [0, 1]
    for fn in live.listeners:  # a heartbeat resets what was bound since the last one
        fn(live.records[1])
    assert picker.pick(0) == 1
    with pytest.raises(NoLiveReplica) as e:
        picker.pick(5)
    assert e.value.why() == "none has registered"


def test_no_live_replica_says_when_each_expired_replica_was_last_heard() -> None:
    class Expired(FakeLive):
        def live(self, service=None, stage=None):
            return []

    with pytest.raises(NoLiveReplica) as e:
        ReplicaPicker(Expired({0: 0, 1: 2})).pick(0)
    assert e.value.silent == {0: 1.5, 1: 1.5}
    assert e.value.why().startswith("replica 0 last heard 1.5 s ago, replica 1 last heard 1.5 s ago (")


def test_an_expired_replica_that_answers_its_probes_is_picked_when_none_is_live() -> None:
    class Expired(FakeLive):
        def live(self, service=None, stage=None):
            return [r for r in self.records if r.replica == 0] if self.zero_live else []

    view = Expired({0: 0, 1: 2})
    view.zero_live = False
    answering = {(0, 1)}
    picker = ReplicaPicker(view, lambda rec: False, lambda s, r: (s, r) in answering)
    assert picker.pick(0) == 1
    judged = ReplicaPicker(view, lambda rec: rec.replica == 1, lambda s, r: (s, r) in answering)
    with pytest.raises(NoLiveReplica):
        judged.pick(0)
    answering.clear()
    with pytest.raises(NoLiveReplica):
        picker.pick(0)
    view.zero_live, answering = True, {(0, 1)}  # a live registration comes first
    assert [picker.pick(0) for _ in range(3)] == [0, 0, 0]


def _record() -> RequestRecord:
    return RequestRecord(
        request_id="r", pipeline="p", gateway_id="g", status=RequestStatus.ADMITTED, route=[0, 1],
        stages=[StageProgress(replica=0), StageProgress(replica=1)], arrival_ns=1, admitted_ns=2, deadline_ns=9, updated_ns=2,
    )  # fmt: skip


def _ev(kind: str, stage: int | None = None, ts: int = 5, **kw) -> LifecycleEvent:
    return LifecycleEvent(request_id="r", kind=kind, ts_ns=ts, stage=stage, **kw)


def test_lifecycle_folds_into_the_record_and_terminal_is_final() -> None:
    rec = _record()
    apply_event(rec, _ev("started", 0, 3))
    apply_event(rec, _ev("stage_done", 0, 4, finish_reason="length"))
    apply_event(rec, _ev("started", 1, 5))
    assert (rec.status, rec.current_stage, rec.stages[0].done_ns) == (RequestStatus.RUNNING, 1, 4)
    apply_event(rec, _ev("finished", 1, 6))
    assert rec.status == RequestStatus.COMPLETED and rec.finish_reason == "length"
    apply_event(rec, _ev("aborted", None, 7, reason="client disconnected"))
    assert rec.status == RequestStatus.COMPLETED and rec.updated_ns == 7


def test_an_ending_event_carries_the_start_of_a_stage_that_sent_no_started() -> None:
    rec = _record()
    apply_event(rec, _ev("stage_done", 0, 9, started_ns=4, finish_reason="stop"))
    assert (rec.status, rec.stages[0].started_ns, rec.stages[0].done_ns) == (RequestStatus.RUNNING, 4, 9)
    apply_event(rec, _ev("finished", 1, 12, started_ns=10))
    assert rec.status == RequestStatus.COMPLETED
    assert (rec.stages[1].started_ns, rec.stages[1].done_ns) == (10, 12)


def test_an_event_delivered_twice_is_folded_once() -> None:
    """An orchestrator that died after its record update and before its ack leaves the event to
    be redelivered to another: the edges it carries must not be counted twice."""
    rec = _record()
    edge = EdgeSummary(from_stage="0", from_replica="0", to_stage="1", to_replica="1", hops=3, bytes=90)
    done = _ev("stage_done", 0, 9, started_ns=4, finish_reason="stop", edges=[edge])
    assert apply_event(rec, done) is True
    assert apply_event(rec, done.replace()) is False
    assert [e.hops for e in rec.edges] == [3] and rec.events == ["stage_done.0.1"]
    # The same kind from the stage's next attempt (after a move) is another event.
    assert apply_event(rec, done.replace(attempt=2)) is True
    assert len(rec.edges) == 2


async def _events_of_a_stage(
    monkeypatch, works_s: float, last: bool
) -> tuple[list[LifecycleEvent], list[LifecycleEvent], tuple[int, int]]:
    """The lifecycle events one stage's context sends for a request it works on ``works_s``: those
    sent while it worked, all of them, and the test's wall clock (ns) just before and after the
    stage took the request's first input."""
    monkeypatch.setattr(request_context, "STARTED_REPORT_DELAY_S", 0.05)
    route = [0, 0] if last else [0, 0, 0]
    first = StageTask(
        request_id="r", gateway_id="g", arrival_ns=0, deadline_ns=0, route=route, kind=TaskKind.CHUNK, seq=0
    )
    ctx = RequestContext(Identity(1, 0), bus=None, first=first)
    sent: list[LifecycleEvent] = []
    monkeypatch.setattr(ctx, "_send", sent.append)
    ctx.inbox.put(Delivery(msg=SimpleNamespace(data=b""), task=first, received_ns=0))
    before = time.time_ns()
    await ctx.next()
    took = (before, time.time_ns())
    if works_s:  # the work itself (a short stage does not yield to the loop: no timer can fire)
        await asyncio.sleep(works_s)
    during = list(sent)
    ctx.lifecycle("stage_done", finish_reason="stop")
    if last:
        ctx.lifecycle("finished")
    ctx.close()
    await asyncio.sleep(0.1)  # time passes past the report delay: a late "started" would come in it
    return during, sent, took


async def test_a_short_stage_reports_its_start_in_its_ending_event(monkeypatch) -> None:
    during, (done,), (before, after) = await _events_of_a_stage(monkeypatch, 0.0, last=False)
    assert during == []
    assert done.kind == "stage_done" and done.started_ns is not None
    assert before <= done.started_ns <= after <= done.ts_ns  # when it took the input, by the test's clock
    during, (fin,), (before, after) = await _events_of_a_stage(monkeypatch, 0.0, last=True)
    assert during == []  # stage_done is folded into finished
    assert fin.kind == "finished" and fin.finish_reason == "stop"
    assert fin.started_ns is not None and before <= fin.started_ns <= after


async def test_a_long_stage_reports_started_while_it_works(monkeypatch) -> None:
    during, (started, done), (before, after) = await _events_of_a_stage(monkeypatch, 0.2, last=False)
    assert during == [started], "started is sent while the stage works, not with its end"
    assert started.kind == "started" and done.kind == "stage_done" and done.started_ns is None
    assert before <= started.ts_ns <= after  # it says when the stage took the input, not when it was sent
    assert done.ts_ns - after >= 0.19e9  # and the end came after the 0.2 s of work (timer granularity aside)


def test_abort_sets_finish_reason_abort() -> None:
    rec = _record()
    apply_event(rec, _ev("aborted", reason="client disconnected"))
    assert (rec.status, rec.finish_reason, rec.error) == (
        RequestStatus.ABORTED,
        "abort",
        "client disconnected",
    )


class _Reply:
    """A route notice as the worker's subscription sees it (data, and where the answer goes)."""

    def __init__(self, change: RouteNotice) -> None:
        self.data = change.encode()
        self.answer: ResumePoint | None = None

    async def respond(self, data: bytes) -> None:
        self.answer = decode(ResumePoint, data)


async def test_a_route_notice_for_a_queued_request_applies_when_it_starts() -> None:
    """The talker has a request queued (``max_inflight`` reached) when code2wav moves: the hold
    and the release are kept and applied when the request starts, so its chunks go to the new
    replica as the new attempt."""
    pipeline = load_pipeline()
    talker, codec = pipeline.speech_stage, pipeline.audio_stage
    pipeline.stages[codec] = pipeline.stages[codec].model_copy(update={"replicas": 2})  # a replica to move to
    worker = StageWorker(WorkerSettings(stage=talker, replica=0, max_inflight=1), pipeline)
    first = _delivery(0).task.replace(request_id="waiting", route=[0] * len(pipeline.stages))
    worker.requests.queue(Delivery(msg=None, task=first, received_ns=0))
    hold = _Reply(ResumeQuery(request_id="waiting", stage=codec, attempt=2, replica=1))
    await worker.control.on_route(hold)
    assert hold.answer == ResumePoint(known=True, next_seq=0)
    release = _Reply(AbortNotice(request_id="waiting", reason=MOVED, stage=codec, attempt=2, replica=1))
    await worker.control.on_route(release)
    unknown = _Reply(ResumeQuery(request_id="gone", stage=codec, attempt=2, replica=1))
    await worker.control.on_route(unknown)
    assert unknown.answer == ResumePoint(known=False)
    # Forged: a replica the pipeline does not declare, a stage that is not the next one, no
    # replica, an abort that is not a move.
    forgeries = [
        AbortNotice(request_id="waiting", reason=MOVED, stage=codec, attempt=2, replica=7),
        AbortNotice(request_id="waiting", reason=MOVED, stage=pipeline.thinker_stage, attempt=2, replica=0),
        AbortNotice(request_id="waiting", reason=MOVED, stage=codec, attempt=2),
        AbortNotice(request_id="waiting", reason="abort", stage=codec, attempt=2, replica=1),
        ResumeQuery(request_id="waiting", stage=codec, attempt=2, replica=7),
    ]
    for notice in forgeries:
        forged = _Reply(notice)
        await worker.control.on_route(forged)
        assert forged.answer == ResumePoint(known=False), notice
    inputs, route = worker.requests.next_queued()
    assert [d.task for d in inputs] == [first]
    ctx = RequestContext(Identity(talker, 0), bus=None, first=first)
    reroute(ctx, route)
    assert ctx.route[codec] == 1 and ctx._next_attempt == 2 and ctx._released.is_set()


def _task(rid: str = "r", attempt: int = 1, from_attempt: int = 1, moved: bool = False) -> StageTask:
    return _delivery(0).task.replace(request_id=rid, attempt=attempt, from_attempt=from_attempt, moved=moved)


def _running(table: RequestTable, task: StageTask) -> RequestContext:
    ctx = RequestContext(Identity(1, 0), bus=None, first=task)
    table.start(ctx, SimpleNamespace(cancel=lambda: None))  # type: ignore[arg-type]
    return ctx


def test_a_request_ends_or_moves_away_and_its_late_inputs_are_dropped_or_left_for_the_move() -> None:
    table = RequestTable()
    assert table.judge(_task()) == Verdict.TAKE
    ctx = _running(table, _task())
    assert table.get("r").phase == Phase.RUNNING and table.judge(_task()) == Verdict.TAKE
    table.end(ctx, moved_away=False)
    assert table.get("r").phase == Phase.ENDED and table.judge(_task()) == Verdict.DROP
    assert table.judge(_task(attempt=2)) == Verdict.TAKE, "a later attempt moved back here is new work"
    ctx = _running(table, _task(attempt=2))
    table.end(ctx, moved_away=True)  # its engine died: the move sends its inputs on
    assert table.get("r").phase == Phase.MOVED_AWAY and table.judge(_task(attempt=2)) == Verdict.LEAVE


def test_a_move_notice_stops_older_attempts_and_makes_older_upstream_chunks_stale() -> None:
    table = RequestTable()
    ctx = _running(table, _task())
    assert table.moved("r", stage=1, attempt=2, my_stage=1, upstream_restarts=False).ctx is ctx, (
        "the older attempt is not stopped"
    )
    assert table.judge(_task()) == Verdict.LEAVE
    assert (
        table.moved("q", stage=0, attempt=3, my_stage=1, upstream_restarts=True) is None
    )  # the thinker moved: a fence here
    assert table.judge(_task("q", from_attempt=2)) == Verdict.STALE
    assert table.judge(_task("q", from_attempt=2, moved=True)) == Verdict.TAKE, "a dead talker's input"
    assert table.judge(_task("q", from_attempt=3)) == Verdict.TAKE
    assert table.aborted("unseen") is None and table.judge(_task("unseen", attempt=5)) == Verdict.DROP


def test_queued_requests_start_in_arrival_order_and_old_entries_are_forgotten_past_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(request_table, "time", SimpleNamespace(monotonic=lambda: now[0]))
    table = RequestTable(keep_s=10.0, max_entries=2)
    for rid in ("b", "a", "b"):
        table.queue(Delivery(msg=None, task=_task(rid), received_ns=0))
    assert [d.task.request_id for d in table.queued_inputs()] == ["b", "b", "a"]
    assert [d.task.request_id for d in table.next_queued()[0]] == ["b", "b"]
    old = _running(table, _task("b"))
    table.end(old, moved_away=False)
    now[0] += 9.9
    table.end(_running(table, _task("c")), moved_away=False)  # past the limit, "b" is young enough
    assert table.get("b") is not None and table.get("a").phase == Phase.QUEUED
    now[0] += 0.2
    table.end(_running(table, _task("d")), moved_away=False)
    assert table.get("b") is None and table.get("a") is not None, "a queued request was forgotten"


def test_the_registry_ages_its_entries_only_while_it_hears_updates() -> None:
    """A worker last heard 7 s ago has expired (TTL 6 s) while the registry hears other services;
    when the watch has heard nothing at all for those 7 s (the bucket unreachable), its clock stopped
    4 s after the last update and the worker is still live."""
    views = LiveServices(kv=None, pipeline="p", ttl_s=6.0)  # type: ignore[arg-type]
    worker = ServiceRecord(service=ServiceKind.WORKER, pipeline="p", instance="w", stage=0, replica=0)
    now = time.monotonic()
    views._entries = {worker.key: (worker, now - 7.0)}
    views._last_update = now - 0.5
    assert views.live(ServiceKind.WORKER) == []
    views._last_update = now - 7.0
    assert views.live(ServiceKind.WORKER) == [worker]
    assert views.last_heard(ServiceKind.WORKER)[0][1] >= 7.0  # the real age stays known


def test_after_a_silence_the_registry_ages_its_entries_from_where_its_clock_stopped() -> None:
    """The bucket was unreachable for 8 s. When the watch hears an update again, a worker last
    heard 1 s before the silence is as old as the stopped clock said (1 + 4 s: live), not 9 s
    (expired until its next beat arrives: no mass expiry on the first update after a silence)."""
    views = LiveServices(kv=None, pipeline="p", ttl_s=6.0)  # type: ignore[arg-type]
    worker = ServiceRecord(service=ServiceKind.WORKER, pipeline="p", instance="w", stage=0, replica=0)
    now = time.monotonic()
    views._entries = {worker.key: (worker, now - 9.0)}
    views._last_update = now - 8.0
    views._resume_clock(now)  # the first update after the silence
    assert views.live(ServiceKind.WORKER) == [worker]
    [(_, age)] = views.last_heard(ServiceKind.WORKER)
    assert 4.9 < age < 5.5, age
    views._resume_clock(now + 1.0)  # an update a second later: no silence, nothing moves
    assert views.last_heard(ServiceKind.WORKER)[0][1] >= 5.0


class _Gateway:
    """A gateway as a worker's :class:`ClientStream` meets it: what it received of one attempt,
    with the events that ``lose`` names never arriving, answering questions with its position."""

    def __init__(self, lose: set[int] = frozenset(), known: bool = True) -> None:
        self.got: list[int] = []
        self.lose = set(lose)
        self.known = known
        self.questions = 0
        self.responders = True
        self.is_connected, self.is_closed = True, False

    async def publish(self, subject: str, data: bytes) -> None:
        seq = int(data.decode()) if data.isdigit() else decode(ClientEvent, data).seq
        if seq in self.lose:
            self.lose.discard(seq)  # lost once
        else:
            self.got.append(seq)

    async def request(self, subject: str, data: bytes, timeout: float) -> SimpleNamespace:
        self.questions += 1
        if not self.responders:
            raise NoRespondersError
        next_seq = 0
        while next_seq in self.got:
            next_seq += 1
        return SimpleNamespace(data=ResumePoint(known=self.known, next_seq=next_seq).encode())


def _stream(gateway: _Gateway) -> ClientStream:
    return ClientStream(gateway, "out.g.r", ResumeQuery(request_id="r", stage=0, attempt=1, replica=0))  # type: ignore[arg-type]


async def _send(stream: ClientStream, gateway: _Gateway, seqs: range) -> None:
    for seq in seqs:
        stream.add(str(seq).encode())
        await gateway.publish("out.g.r", str(seq).encode())


async def test_a_worker_keeps_its_client_events_until_the_gateway_has_them_and_sends_lost_ones_again() -> (
    None
):
    gateway = _Gateway(lose={2, 3})
    stream = _stream(gateway)
    await _send(stream, gateway, range(6))
    assert gateway.got == [0, 1, 4, 5]
    await stream.confirm(6)
    assert set(gateway.got) == set(range(6)) and gateway.got[4:6] == [2, 3], "sent again in order"
    assert (stream.confirmed, stream.sent, stream.ended) == (6, 6, False)


async def test_a_question_leaves_after_the_events_sent_before_it_so_none_is_sent_twice() -> None:
    """Events still in the worker's sender when the question is asked go out first (``flushed``):
    the gateway has them all, and nothing is sent again."""
    gateway = _Gateway()
    waiting: list[bytes] = []

    async def flushed() -> None:
        for data in waiting:
            await gateway.publish("out.g.r", data)
        waiting.clear()

    query = ResumeQuery(request_id="r", stage=0, attempt=1, replica=0)
    stream = ClientStream(gateway, "out.g.r", query, flushed)  # type: ignore[arg-type]
    for seq in range(3):
        waiting.append(str(seq).encode())
        stream.add(str(seq).encode())
    await stream.confirm(3)
    assert gateway.got == [0, 1, 2] and gateway.questions == 1


async def test_a_client_stream_ends_when_the_gateway_no_longer_takes_it_or_is_gone(monkeypatch) -> None:
    moved = _Gateway(lose={0}, known=False)  # the request moved past the attempt, or its client left
    stream = _stream(moved)
    await _send(stream, moved, range(2))
    await stream.confirm(2)
    assert stream.ended and stream.confirmed == 0
    gone = _Gateway()
    gone.responders = False
    monkeypatch.setattr(client_stream, "GATEWAY_GONE_S", 0.0)
    stream = _stream(gone)
    await _send(stream, gone, range(1))
    async with asyncio.timeout(5):
        await stream.confirm(1)
    assert stream.ended


async def test_an_attempt_that_ended_delivers_its_lost_last_event_all_the_same(monkeypatch) -> None:
    """The last event (``audio_done``) is lost and the gateway is away for a while (reconnecting):
    the attempt ends at once here (its input acknowledged, nothing waits for the gateway) and its
    worker goes on asking until the gateway has the event."""
    monkeypatch.setattr(client_stream, "RETRY_S", 0.01)
    gateway = _Gateway(lose={0})
    gateway.responders = False
    ctx = RequestContext(
        Identity(2, 0),
        request_context.Bus(gateway, SimpleNamespace(), SimpleNamespace(out=lambda g, r: "out.g.r")),  # type: ignore[arg-type]
        StageTask(
            request_id="r",
            gateway_id="g",
            arrival_ns=0,
            deadline_ns=time.time_ns() + 10**10,
            route=[0, 0, 0],
            kind=TaskKind.CHUNK,
            seq=0,
        ),
    )
    acked: list[int] = []

    async def ack() -> None:
        acked.append(0)

    d = Delivery(SimpleNamespace(ack=ack), ctx.first, 0)  # type: ignore[arg-type]
    ctx.inbox.put(d)
    assert await ctx.next() is d
    await ctx.client(ClientEvent(request_id="r", type=ClientEventType.AUDIO_DONE))
    await ctx.ack(d)
    ctx.close()
    assert acked == [0] and gateway.got == []
    await asyncio.sleep(0.05)
    gateway.responders = True
    for _ in range(200):
        if ctx.stream.confirmed:
            break
        await asyncio.sleep(0.01)
    assert gateway.got == [0], "the lost last event was not sent again"
    assert ctx.stream.confirmed == 1
