"""The chaos soak's accounting (pure): requests attributed to the faults they overlapped in time,
the totals, and streams with tokens or audio missing or repeated."""

from __future__ import annotations

from benchmarks.chat_streams import Seen
from tests.verification.chaos_accounting import Ask, Record, Strike, account, explain, lost_or_hung, render

TEXT = Ask("p", 3, audio=False, stream=True)
AUDIO = Ask("p", 3, audio=True, stream=True)
WHOLE = Ask("p", 3, audio=False, stream=False)
REFS = {
    TEXT.key: Seen(token_ids=[1, 2, 3], text="a b c", usage_tokens=3),
    AUDIO.key: Seen(token_ids=[1, 2, 3], text="a b c", usage_tokens=3, audio_bytes=960, audio_chunks=2),
}
HUNG_AFTER_S = 150.0


def ok(sent: float, ended: float, at: list[float] | None = None, **kw: object) -> Seen:
    """A request that completed with the reference's tokens."""
    fields = {"token_ids": [1, 2, 3], "text": "a b c", "usage_tokens": 3, **kw}
    return Seen(sent_s=sent, ended_s=ended, at=at if at is not None else [ended], **fields)


def test_requests_are_attributed_to_every_fault_they_overlap_and_once_to_the_total() -> None:
    strikes = [
        Strike("kill -9 a thinker replica [thinker-0]", 100.0, 130.0, "pid 7 Z", True),
        Strike("kill -9 the orchestrator [orchestrator]", 120.0, 125.0, "pid 9 gone", True, "thinker-0"),
    ]
    records = [
        Record(TEXT, ok(10.0, 50.0)),  # before both faults: no row
        Record(TEXT, ok(90.0, 105.0, at=[95.0, 98.0, 104.0])),  # overlaps the first only
        Record(WHOLE, ok(115.0, 122.0)),  # overlaps both
        Record(
            TEXT, Seen(sent_s=126.0, ended_s=127.0, error="no_live_replica", error_code="no_live_replica")
        ),
        Record(TEXT, Seen(sent_s=128.0, ended_s=129.0, error="APIConnectionError")),  # no code
        Record(TEXT, ok(140.0, 150.0)),  # after both: no row
    ]
    acc = account(strikes, records, REFS, HUNG_AFTER_S, end_s=200.0)
    (_, first), (_, second) = acc.rows
    assert (first.sent, first.completed, first.failed, first.no_code, first.hung) == (
        4,
        2,
        {"no_live_replica": 1},
        1,
        0,
    )
    assert first.no_code_kinds == {"APIConnectionError": 1}
    assert (second.sent, second.completed, second.failed, second.no_code) == (1, 1, {}, 0)
    assert (acc.quiet.sent, acc.quiet.completed) == (2, 2)
    t = acc.total
    assert (t.sent, t.completed, t.failed, t.no_code, t.hung, t.tokens_wrong, t.audio_wrong) == (
        6,
        4,
        {"no_live_replica": 1},
        1,
        0,
        0,
        0,
    )
    assert t.completed + sum(t.failed.values()) + t.no_code + t.hung == t.sent
    assert first.pause_s == 6.0  # 98 -> 104 overlaps the first fault's window (100..130)
    assert not lost_or_hung(acc)


def test_a_wrong_or_repeated_token_stream_and_short_audio_are_counted() -> None:
    strikes = [Strike("kill -9 a talker replica [talker-1]", 10.0, 40.0, "pid 3 gone", True)]
    repeated = ok(5.0, 20.0, token_ids=[1, 2, 2, 3], usage_tokens=4)
    unlike = ok(5.0, 20.0, token_ids=[1, 2, 4], text="a b d")  # right count, other tokens
    same_ids_other_text = ok(5.0, 20.0, text="a b c c")
    short_audio = ok(5.0, 20.0, audio_bytes=480, audio_chunks=1)
    extra_chunk = ok(5.0, 20.0, audio_bytes=960, audio_chunks=3)
    whole_audio = ok(5.0, 20.0, audio_bytes=960, audio_chunks=1)  # not streamed: chunks not compared
    records = [
        Record(TEXT, repeated),
        Record(TEXT, unlike),
        Record(TEXT, same_ids_other_text),
        Record(AUDIO, short_audio),
        Record(AUDIO, extra_chunk),
        Record(Ask("p", 3, audio=True, stream=False), whole_audio),
    ]
    acc = account(strikes, records, REFS, HUNG_AFTER_S, end_s=60.0)
    (_, row), total = acc.rows[0], acc.total
    assert (row.sent, row.completed, row.tokens_wrong, row.audio_wrong) == (6, 6, 3, 2)
    assert (total.tokens_wrong, total.audio_wrong) == (3, 2)
    assert lost_or_hung(acc)


def test_a_hung_request_overlaps_until_it_counted_as_hung_and_a_fault_not_over_until_the_end() -> None:
    strikes = [
        Strike("SIGSTOP a thinker replica 30 s [thinker-1]", 300.0, None, "pid 5 T", True),
        Strike("kill -9 nats-server, back 2 s later [nats-server]", 600.0, 610.0, "pid 8 gone", False),
    ]
    hung = Seen(sent_s=200.0, at=[201.0])  # in flight until 350 (200 + 150)
    late = ok(500.0, 520.0)  # the first fault is not over: its window runs to the end (700)
    acc = account(strikes, [Record(TEXT, hung), Record(TEXT, late)], REFS, HUNG_AFTER_S, end_s=700.0)
    (_, stopped), (_, nats) = acc.rows
    assert (stopped.sent, stopped.hung, stopped.completed) == (2, 1, 1)
    assert nats.sent == 0
    assert acc.total.hung == 1
    assert lost_or_hung(acc)
    table = render(acc, t0_s=0.0)
    assert (
        "| 300 | SIGSTOP a thinker replica 30 s [thinker-1] | pid 5 T | - | not over | 2 | 1 | 0 | 0 | 1 |"
        in table
    )
    assert "NOT VERIFIED: pid 8 gone" in table
    assert "| - | total (2 faults) | - | - | - | 2 | 1 | 0 | 0 | 1 | 0 | 0 |" in table


def test_what_is_wrong_with_a_request_is_explained_in_one_line() -> None:
    ref = Seen(token_ids=list(range(20)), text="t", usage_tokens=20)
    ask = Ask("p", 20, audio=False, stream=True)

    def line(**kw: object) -> str | None:
        fields = {"id": "chatcmpl-1", "sent_s": 0.0, "ended_s": 1.0, "text": "t", "usage_tokens": 20, **kw}
        return explain(Record(ask, Seen(**fields)), ref)

    assert line(token_ids=list(range(20))) is None
    missing = [*range(7), *range(9, 20), 98, 99]  # two tokens skipped at 7, the count still right
    assert "leave the reference at 7 (missing 2)" in line(token_ids=missing)
    repeated = [*range(12), 11, *range(12, 19)]
    assert "leave the reference at 12 (repeated 1)" in line(token_ids=repeated)
    other = [*range(15), 50, 51, 52, 53, 54]
    assert "leave the reference at 15 (other tokens)" in line(token_ids=other)
    assert "leave the reference at 10" in line(token_ids=list(range(10)), usage_tokens=10)
    assert line(token_ids=[], error="replica_lost", error_code="replica_lost", status=503).endswith(
        "failed 503 replica_lost after 0 tokens"
    )
    assert "hung" in line(token_ids=[1], ended_s=None)
