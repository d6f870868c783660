"""The bus contract: subject and stream names, envelope round trips, malformed bodies."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from libs.common import headers as h
from libs.common.envelopes import MalformedMessage, NdArray, Sampling, StageTask, TaskKind, decode
from libs.common.subjects import Subjects, consumer_name


def test_subjects_and_streams_follow_the_design() -> None:
    s = Subjects("omni")
    assert s.requests == "omni.omni.requests"
    assert s.stage_in(1, 2) == "omni.omni.stage.1.2.in"
    assert s.out("gw-1", "chatcmpl-abc") == "omni.omni.out.gw-1.chatcmpl-abc"
    assert s.event("stage_done") == "omni.omni.events.stage_done"
    assert s.abort == "omni.omni.ctl.abort"
    assert (s.requests_stream, s.stages_stream, s.events_stream) == (
        "OMNI_OMNI_REQUESTS",
        "OMNI_OMNI_STAGES",
        "OMNI_OMNI_EVENTS",
    )
    assert Subjects("text-only").stages_stream == "OMNI_TEXT_ONLY_STAGES"
    assert consumer_name(0, 1) == "stage-0-1"


def test_subject_tokens_are_checked() -> None:
    with pytest.raises(ValueError, match="subject token"):
        Subjects("a.b")
    with pytest.raises(ValueError, match="unknown event kind"):
        Subjects("omni").event("exploded")


def task(**kw) -> StageTask:
    base = dict(
        request_id="r",
        gateway_id="g",
        arrival_ns=1,
        deadline_ns=2,
        route=[0, 1, 0],
        kind=TaskKind.CHUNK,
        seq=3,
    )
    return StageTask(**{**base, **kw})


def test_stage_task_round_trips_with_arrays() -> None:
    codes = np.arange(7, dtype=np.int32)
    t = task(codes=NdArray.of(codes), final=True, sampling=Sampling(max_tokens=5, stop=["."]))
    back = decode(StageTask, t.encode())
    assert back == t
    np.testing.assert_array_equal(back.codes.to_numpy(), codes)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (msgpack.packb([1, 2]), "not_a_map"),
        (msgpack.packb({"request_id": "r"}), "invalid_envelope"),
        (msgpack.packb({**msgspec.to_builtins(task()), "seq": -1}), "invalid_envelope"),
    ],
)
def test_malformed_bodies_raise_with_a_reason(body: bytes, reason: str) -> None:
    with pytest.raises(MalformedMessage) as e:
        decode(StageTask, body)
    assert e.value.reason == reason


def test_bad_array_payload_is_malformed() -> None:
    arr = NdArray(dtype="<i4", shape=[3], data=b"\x00" * 5)
    with pytest.raises(MalformedMessage, match="bad array payload"):
        arr.to_numpy()


def test_header_helpers() -> None:
    hdr = {h.SEQ: "4", h.FINAL: "true", h.TO_STAGE: "x"}
    assert h.header_int(hdr, h.SEQ) == 4
    assert h.header_int(hdr, h.TO_STAGE) is None and h.header_int(None, h.SEQ) is None
