"""The text delta's array layout on the bus (``envelopes.TEXT_LAYOUT``): packed without pydantic,
decoded to the event the pydantic model makes of the same fields, refused as the model refuses them.

The ground truth is the old wire format, a map of the same fields, which only the pydantic model
judges (``ClientEvent.from_body`` special-cases arrays only)."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.common.envelopes import (
    MAX_ID_CHARS,
    TEXT_LAYOUT,
    ClientEvent,
    ClientEventType,
    MalformedMessage,
    StageTask,
    TaskKind,
    decode,
    pack_text,
    plain_text,
)
from libs.common.subjects import Subjects
from services.stage_worker.request_context import Bus, Identity, RequestContext
from services.stage_worker.sent_events import SentEvents

MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
IDS = st.from_regex(rf"[A-Za-z0-9_-]{{1,{MAX_ID_CHARS}}}", fullmatch=True)
TOKEN_IDS = st.lists(MSGPACK_INTS, max_size=8)


def _outcome(data: bytes) -> tuple[str, object]:
    """What decoding ``data`` as a ClientEvent gives: the event's fields and the fields it was
    given, or the refusal's reason and text."""
    try:
        event = decode(ClientEvent, data)
    except MalformedMessage as e:
        return "refused", (e.reason, str(e))
    values = repr([(name, getattr(event, name)) for name in ClientEvent.model_fields])  # 1 ≠ True here
    return "event", (values, event.model_fields_set)


def _as_map_body(items: list) -> bytes:
    """The same fields as the map the pydantic model judges."""
    return msgpack.packb(dict(zip(TEXT_LAYOUT, items, strict=True)), use_bin_type=True)


@settings(max_examples=400, deadline=None)
@given(
    rid=IDS,
    stage=MSGPACK_INTS,
    replica=MSGPACK_INTS,
    seq=MSGPACK_INTS,
    attempt=MSGPACK_INTS,
    text=st.text(max_size=40),
    token_ids=TOKEN_IDS,
)
def test_a_packed_text_delta_decodes_to_the_models_round_trip(
    rid: str, stage: int, replica: int, seq: int, attempt: int, text: str, token_ids: list[int]
) -> None:
    data = pack_text(rid, stage, replica, seq, attempt, text, token_ids)
    assert plain_text(msgpack.unpackb(data, raw=False)), "the direct path (no pydantic) decodes it"
    fields = {"stage": stage, "replica": replica, "seq": seq, "attempt": attempt, "text": text}
    model = ClientEvent(request_id=rid, type=ClientEventType.TEXT, token_ids=token_ids, **fields)
    old = decode(ClientEvent, model.encode())
    new = decode(ClientEvent, data)
    assert new == old and new.model_dump() == old.model_dump() == model.model_dump()
    assert type(new.type) is ClientEventType and new.type is ClientEventType.TEXT
    assert new.model_fields_set == set(TEXT_LAYOUT)
    assert new.token_ids is not ClientEvent(request_id="r", type="text").token_ids  # no shared default
    assert _outcome(data) == _outcome(_as_map_body(msgpack.unpackb(data, raw=False)))


WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.from_regex(r"-?[0-9]{1,3}", fullmatch=True),
    st.binary(max_size=4),
    st.lists(st.one_of(MSGPACK_INTS, st.booleans(), st.floats(), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
    MSGPACK_INTS,
    st.sampled_from(["", "a.b", "a b", "*", ">", "a\n", "é", "a\x00", "x" * (MAX_ID_CHARS + 1)]),
)
"""Values of other types (or ids the model refuses) that the model converts or refuses."""
VALID = st.tuples(
    st.just("text"),
    IDS,
    MSGPACK_INTS,
    MSGPACK_INTS,
    MSGPACK_INTS,
    MSGPACK_INTS,
    st.text(max_size=8),
    TOKEN_IDS,
)


@settings(max_examples=2000, deadline=None)
@given(items=VALID, slots=st.sets(st.integers(1, len(TEXT_LAYOUT) - 1), max_size=3), data=st.data())
def test_any_text_delta_array_is_judged_as_the_model_judges_its_map(
    items: tuple, slots: set[int], data
) -> None:
    """A valid array with up to three items (of the seven after the tag) made wrong."""
    body = list(items)
    for i in slots:
        body[i] = data.draw(WRONG)
    got, expected = _outcome(msgpack.packb(body, use_bin_type=True)), _outcome(_as_map_body(body))
    assert got == expected
    if plain_text(body):
        assert got[0] == "event", "the direct path takes only what the model takes"


WRONG_SAMPLES = [
    None,
    True,
    False,
    0,
    -1,
    2**64 - 1,
    1.0,
    1.5,
    float("nan"),
    "",
    "5",
    "a.b",
    "a b",
    "*",
    "a\n",
]
WRONG_SAMPLES += [
    "é",
    "x" * MAX_ID_CHARS,
    "x" * (MAX_ID_CHARS + 1),
    b"",
    b"r",
    [],
    [1, True],
    [1.0],
    ["1"],
    {"a": 1},
]
BASE = ["text", "req-1", 0, 1, 2, 1, "hi", [5, 6]]


@pytest.mark.parametrize("slot", range(1, len(TEXT_LAYOUT)))
def test_each_item_of_each_type_alone_is_judged_as_the_model_judges_it(slot: int) -> None:
    """Every value of :data:`WRONG_SAMPLES` in every slot of a valid array (hypothesis draws the
    rare ones seldom: an id with a dot, a bool where an int goes)."""
    for value in WRONG_SAMPLES:
        body = [*BASE[:slot], value, *BASE[slot + 1 :]]
        got = _outcome(msgpack.packb(body, use_bin_type=True))
        assert got == _outcome(_as_map_body(body)), (TEXT_LAYOUT[slot], value)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (["text", "r", 0, 0, 1, 1, "a"], "invalid_envelope"),  # an item short
        (["text", "r", 0, 0, 1, 1, "a", [1], "extra"], "invalid_envelope"),
        (["text"], "invalid_envelope"),
        (["started", "r", 0, 0, 1, 1, "a", [1]], "not_a_map"),  # arrays are text deltas only
        ([1, 2, 3], "not_a_map"),
        ([], "not_a_map"),
    ],
)
def test_other_arrays_are_refused(body: list, reason: str) -> None:
    with pytest.raises(MalformedMessage) as e:
        decode(ClientEvent, msgpack.packb(body))
    assert e.value.reason == reason


def test_maps_still_decode_as_before() -> None:
    event = ClientEvent(
        request_id="r", type=ClientEventType.TEXT, stage=0, replica=1, seq=2, text="a", token_ids=[3]
    )
    assert decode(ClientEvent, event.encode()) == event
    with pytest.raises(MalformedMessage) as e:
        decode(ClientEvent, msgpack.packb({**event.model_dump(), "request_id": "a.b"}))
    assert e.value.reason == "invalid_envelope"


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
    ctx = RequestContext(Identity(0, 3, 1), Bus(nc, SimpleNamespace(), subjects), first, sent=SentEvents())
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
    assert ctx.sent.get("req1", 2, 0, 3) == [data for _, data in nc.sent], "kept for a replay as sent"
