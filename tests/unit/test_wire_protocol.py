"""The bus's message bodies (``libs.common.envelopes``): each kind decodes to what was encoded, and
a body that is not msgpack, not the kind's shape, or carries a field of the wrong type or out of its
bounds is refused with the reason the receivers count (``vllm:omni_bus_messages_terminated_total``)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.common.envelopes import (
    MAX_ID_CHARS,
    Admission,
    ClientEvent,
    ClientEventType,
    LifecycleEvent,
    MalformedMessage,
    Sampling,
    StageTask,
    TaskKind,
    Usage,
    decode,
)
from libs.common.subjects import Subjects
from services.stage_worker.request_context import Bus, Identity, RequestContext

MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
IDS = st.from_regex(rf"[A-Za-z0-9_-]{{1,{MAX_ID_CHARS}}}", fullmatch=True)


def _reason(cls: type, body: object) -> str | None:
    """The refusal's reason for ``body`` packed as msgpack, or None when it decodes."""
    try:
        decode(cls, msgspec.msgpack.encode(body))
    except MalformedMessage as e:
        return e.reason
    return None


@settings(max_examples=300, deadline=None)
@given(
    rid=IDS,
    stage=MSGPACK_INTS,
    replica=MSGPACK_INTS,
    seq=MSGPACK_INTS,
    attempt=MSGPACK_INTS,
    text=st.text(max_size=40),
    token_ids=st.lists(MSGPACK_INTS, max_size=8),
)
def test_any_text_delta_decodes_to_what_was_sent(
    rid: str, stage: int, replica: int, seq: int, attempt: int, text: str, token_ids: list[int]
) -> None:
    event = ClientEvent(
        type=ClientEventType.TEXT,
        request_id=rid,
        stage=stage,
        replica=replica,
        seq=seq,
        attempt=attempt,
        text=text,
        token_ids=token_ids,
    )
    back = decode(ClientEvent, event.encode())
    assert back == event and back.type is ClientEventType.TEXT


def test_a_one_token_delta_is_small() -> None:
    event = ClientEvent(
        type=ClientEventType.TEXT, request_id="chatcmpl-" + "x" * 24, stage=0, replica=1, seq=9, text=" the"
    )
    event.token_ids = [1234]
    assert len(event.encode()) <= len(event.request_id) + len(event.text) + 32  # values, no names


def test_every_kind_round_trips() -> None:
    kinds = [
        Admission(
            request_id="r",
            gateway_id="g",
            arrival_ns=1,
            deadline_ns=2,
            prompt_token_ids=[1, 2],
            sampling=Sampling(max_tokens=5, stop=["."], seed=3),
        ),
        StageTask(
            request_id="r", gateway_id="g", arrival_ns=1, deadline_ns=2, route=[0], kind=TaskKind.START, seq=0
        ),
        LifecycleEvent(request_id="r", kind="stage_done", ts_ns=5, finish_reason="stop"),
        ClientEvent(
            type=ClientEventType.TEXT_DONE, request_id="r", usage=Usage(prompt_tokens=1, completion_tokens=2)
        ),
        ClientEvent(
            type=ClientEventType.AUDIO, request_id="r", pcm16=b"\x00\x01", sample_rate=24000, in_seq=3
        ),
    ]
    for message in kinds:
        assert decode(type(message), message.encode()) == message


GOOD_TEXT = ["text", "req-1", 0, 1, 2, 1, "hi", [5, 6]]
GOOD_ADMISSION = {"request_id": "r", "gateway_id": "g", "arrival_ns": 1, "deadline_ns": 2}


@pytest.mark.parametrize(
    ("cls", "body", "reason"),
    [
        (ClientEvent, GOOD_TEXT, None),
        (ClientEvent, {"type": "text", "request_id": "r"}, "not_a_map"),  # the shape is an array
        (ClientEvent, 7, "not_a_map"),
        (ClientEvent, ["text"], "invalid_envelope"),  # an item short
        (ClientEvent, ["nope", "r"], "invalid_envelope"),
        (ClientEvent, [*GOOD_TEXT[:1], "a.b", *GOOD_TEXT[2:]], "invalid_envelope"),  # not a subject token
        (ClientEvent, [*GOOD_TEXT[:1], "x" * (MAX_ID_CHARS + 1), *GOOD_TEXT[2:]], "invalid_envelope"),
        (ClientEvent, [*GOOD_TEXT[:4], True, *GOOD_TEXT[5:]], "invalid_envelope"),  # a bool for an int
        (ClientEvent, [*GOOD_TEXT[:7], [1.5]], "invalid_envelope"),
        (Admission, GOOD_ADMISSION, None),
        (Admission, [1, 2], "not_a_map"),
        (Admission, {**GOOD_ADMISSION, "entry_stage": -1}, "invalid_envelope"),
        (Admission, {**GOOD_ADMISSION, "sampling": {"max_tokens": 0}}, "invalid_envelope"),
        (Admission, {**GOOD_ADMISSION, "later_field": 1}, None),  # a newer sender's field is ignored
        (Admission, {"request_id": "r"}, "invalid_envelope"),
    ],
)
def test_bodies_are_judged_with_a_reason(cls: type, body: object, reason: str | None) -> None:
    assert _reason(cls, body) == reason


def test_a_body_that_is_not_msgpack_is_refused() -> None:
    with pytest.raises(MalformedMessage) as e:
        decode(StageTask, b"\xc1")
    assert e.value.reason == "not_msgpack"


class _Nats:
    """Stands in for the NATS client: records what is published."""

    is_connected = True

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, data))


async def test_the_worker_numbers_keeps_and_sends_text_and_other_events_alike() -> None:
    nc, subjects = _Nats(), Subjects("p")
    first = StageTask(
        request_id="req1",
        gateway_id="gw1",
        arrival_ns=0,
        deadline_ns=2**62,
        route=[0],
        kind=TaskKind.START,
        seq=0,
        attempt=2,
    )
    ctx = RequestContext(Identity(0, 3), Bus(nc, SimpleNamespace(), subjects), first)
    await ctx.client(ClientEvent(request_id="req1", type=ClientEventType.STARTED))
    await ctx.client_text("Hi", [7, 8])
    await ctx.client(ClientEvent(request_id="req1", type=ClientEventType.TEXT, text="!", token_ids=[9]))
    assert {s for s, _ in nc.sent} == {subjects.out("gw1", "req1")}
    events = [decode(ClientEvent, data) for _, data in nc.sent]
    assert [(e.type, e.seq, e.stage, e.replica, e.attempt) for e in events] == [
        (ClientEventType.STARTED, 0, 0, 3, 2),
        (ClientEventType.TEXT, 1, 0, 3, 2),
        (ClientEventType.TEXT, 2, 0, 3, 2),
    ]
    assert (events[1].text, events[1].token_ids) == ("Hi", [7, 8])
    kept = list(ctx.stream._events)
    assert kept == [data for _, data in nc.sent], "kept until confirmed, as sent"
    ctx.close()
