"""The application's checks behind the broker's permissions (docs/security.md, "What the
application checks"): each forged or stale message is dropped (or, for an error's status,
replaced) and counted once under its reason; each genuine one passes."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from libs.common.bus_trust import REJECTED_FAMILY, Rejected, metrics_url_problem, rejection_counter
from libs.common.envelopes import (
    ClientEvent,
    ClientEventType,
    ResumePoint,
    ResumeQuery,
    decode,
)
from libs.common.metrics_catalog import Exporter, MetricSet
from libs.common.pipeline import PipelineConfig
from libs.common.registry import LiveServices, ServiceKind, ServiceRecord, record_problem
from libs.common.settings import GatewaySettings
from libs.common.subjects import Subjects
from services.gateway.discovery import sd_targets
from services.gateway.event_trust import REMEMBERED_RELEASES, Attempts, EventTrust
from services.gateway.pipeline_client import PipelineClient, RequestHandle

GW = "gw-1"
PIPELINE = PipelineConfig.model_validate(
    {
        "name": "trust",
        "served_model_name": "trust-model",
        "stages": [
            {"name": "thinker", "type": "llm", "model": "m", "replicas": 2, "consumes": "text", "emits": "text"},
            {
                "name": "talker",
                "type": "llm",
                "model": "m",
                "consumes": "text",
                "emits": "codec_codes",
                "migration_limit": 1,
            },
            {"name": "code2wav", "type": "codec", "model": "m", "replicas": 2, "consumes": "codec_codes", "emits": "audio"},
        ],
    }
)  # fmt: skip
SUBJECTS = Subjects(PIPELINE.name)


def event(**fields) -> ClientEvent:
    base = {"request_id": "r1", "type": ClientEventType.TEXT, "stage": 0, "replica": 0, "text": "x"}
    return ClientEvent(**{**base, **fields})


@pytest.fixture
def counted() -> Counter[Rejected]:
    return Counter()


@pytest.fixture
def trust(counted) -> EventTrust:
    return EventTrust(PIPELINE, GW, lambda reason: counted.update([reason]))


# --- client events ---------------------------------------------------------------------------
def test_the_subject_must_name_the_events_request_on_this_gateway(trust) -> None:
    ev = event()
    assert trust.subject_names(SUBJECTS.out(GW, "r1"), ev.request_id)
    assert not trust.subject_names(SUBJECTS.out(GW, "r2"), ev.request_id)
    assert not trust.subject_names(SUBJECTS.out(GW, "r1") + ".x", ev.request_id)
    assert not trust.subject_names(SUBJECTS.out("gw-2", "r1"), ev.request_id)
    assert not trust.subject_names(Subjects("other").out(GW, "r1"), ev.request_id)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"stage": None, "replica": None},
            Rejected.BAD_STAGE,
        ),  # only the orchestrator's errors have no stage
        ({"stage": 3}, Rejected.BAD_STAGE),
        ({"stage": -1}, Rejected.BAD_STAGE),
        ({"stage": 2}, Rejected.BAD_STAGE),  # text from the audio stage
        ({"stage": 1, "type": ClientEventType.STARTED}, Rejected.BAD_STAGE),
        ({"type": ClientEventType.AUDIO, "pcm16": b"\0\0"}, Rejected.BAD_STAGE),  # audio from stage 0
        ({"attempt": 2}, Rejected.BAD_ATTEMPT),  # never announced
        ({"attempt": 0}, Rejected.BAD_ATTEMPT),
        ({"replica": 2}, Rejected.WRONG_REPLICA),  # stage 0 declares 2 replicas: 0 and 1
        ({"replica": None}, Rejected.WRONG_REPLICA),
    ],
)
def test_an_event_from_no_attempt_the_request_binds_is_rejected(trust, fields, reason) -> None:
    assert trust.origin(event(**fields), Attempts()) == reason


def test_genuine_origins_pass(trust) -> None:
    attempts = Attempts()
    assert trust.origin(event(), attempts) is None
    assert (
        trust.origin(event(stage=None, replica=None, type=ClientEventType.ERROR, status=503), attempts)
        is None
    )
    assert trust.origin(event(stage=1, type=ClientEventType.ERROR, status=500), attempts) is None
    assert trust.origin(event(stage=2, replica=1, type=ClientEventType.AUDIO_DONE), attempts) is None


def test_the_bound_replica_of_an_attempt_is_the_only_one_taken(trust) -> None:
    attempts = Attempts()
    attempts.replica[(0, 1)] = 1
    assert trust.origin(event(replica=0), attempts) == Rejected.WRONG_REPLICA
    assert trust.origin(event(replica=1), attempts) is None
    attempts.fence[0] = 2  # announced; attempt 2 on replica 0
    attempts.replica[(0, 2)] = 0
    assert trust.origin(event(attempt=2, replica=1), attempts) == Rejected.WRONG_REPLICA
    assert trust.origin(event(attempt=2, replica=0), attempts) is None
    assert trust.origin(event(attempt=1, replica=1), attempts) is None  # stale: the fence drops it
    assert trust.origin(event(attempt=3, replica=0), attempts) == Rejected.BAD_ATTEMPT


@pytest.mark.parametrize(
    ("status", "code", "forwarded"),
    [
        (503, "no_live_replica", True),
        (400, "", True),
        (200, "stage_error", False),
        (302, "stage_error", False),
        (418, "stage_error", False),
        (600, "stage_error", False),
        (500, "<b>click here</b>", False),
        (500, "A" * 70, False),
    ],
)
def test_an_error_status_the_gateway_does_not_know_becomes_502(
    trust, counted, status, code, forwarded
) -> None:
    ev = event(type=ClientEventType.ERROR, status=status, code=code, message="secret internals")
    out = trust.error_checked(ev)
    if forwarded:
        assert out is ev and not counted
        return
    assert (out.status, out.code) == (502, "bad_status")
    assert "secret" not in out.message and out.request_id == ev.request_id
    assert counted == Counter({Rejected.BAD_STATUS: 1})


def test_late_events_of_a_request_let_go_of_are_told_from_unknown_ones(trust) -> None:
    trust.released("r1")
    assert trust.not_held("r1") == Rejected.ENDED_REQUEST
    assert trust.not_held("r2") == Rejected.UNKNOWN_REQUEST
    for i in range(REMEMBERED_RELEASES):
        trust.released(f"x{i}")
    assert trust.not_held("r1") == Rejected.UNKNOWN_REQUEST  # the oldest is forgotten: bounded


# --- control messages to the gateway -------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"stage": 3}, Rejected.BAD_STAGE),
        ({"attempt": 1}, Rejected.BAD_ATTEMPT),  # a move always starts attempt 2 or later
        ({"stage": 1, "attempt": 3}, Rejected.BAD_ATTEMPT),  # the talker's migration_limit is 1
        ({"attempt": 5}, Rejected.BAD_ATTEMPT),  # default migration_limit 3: attempts up to 4
        ({"replica": 2}, Rejected.WRONG_REPLICA),
        ({}, None),
        ({"replica": None}, None),  # an orchestrator that names no replica
        ({"stage": 1, "attempt": 2, "replica": 0}, None),
    ],
)
def test_a_resume_question_must_be_a_move_the_pipeline_may_make(trust, fields, reason) -> None:
    query = ResumeQuery(**{"request_id": "r1", "stage": 0, "attempt": 2, "replica": 1, **fields})
    assert trust.resume(query) == reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"stage": 1}, Rejected.BAD_STAGE),  # the talker streams nothing
        ({"stage": 4}, Rejected.BAD_STAGE),
        ({"attempt": 2}, Rejected.BAD_ATTEMPT),  # never announced
        ({"replica": 1}, Rejected.WRONG_REPLICA),  # (0, 1) is bound to replica 0
        ({"replica": 9}, Rejected.WRONG_REPLICA),
        ({}, None),
        ({"stage": 2, "replica": 1}, None),
    ],
)
def test_a_workers_question_must_come_from_the_attempt_it_asks_about(trust, fields, reason) -> None:
    attempts = Attempts()
    attempts.replica[(0, 1)] = 0
    query = ResumeQuery(**{"request_id": "r1", "stage": 0, "attempt": 1, "replica": 0, **fields})
    assert trust.question(query, attempts) == reason


# --- the checks wired into the gateway's bus client ------------------------------------------------
class Reply:
    def __init__(self) -> None:
        self.data: bytes | None = None

    async def respond(self, data: bytes) -> None:
        self.data = data


def msg(subject: str, body, reply: Reply | None = None, inbox: str | None = None) -> SimpleNamespace:
    """A message as a subscription sees it; ``inbox``: sent as a request."""
    return SimpleNamespace(
        subject=subject, data=body.encode(), reply=inbox, respond=(reply or Reply()).respond
    )


@pytest.fixture
def client(counted) -> PipelineClient:
    stale: list[int] = []
    c = PipelineClient(
        GatewaySettings(instance_id=GW),
        PIPELINE,
        stale.append,
        lambda _stage: None,
        on_rejected=lambda reason: counted.update([reason]),
    )
    c.stale = stale  # type: ignore[attr-defined]
    return c


def hold(client: PipelineClient, rid: str = "r1") -> RequestHandle:
    handle = RequestHandle(rid, time.time_ns() + 10**10)
    client._handles[rid] = handle
    return handle


def taken(handle: RequestHandle) -> list[tuple[str, int | None, int, int]]:
    out = []
    while not handle.queue.empty():
        ev = handle.queue.get_nowait()
        out.append((ev.text or ev.type.value, ev.replica, ev.attempt, ev.seq))
    return out


async def test_the_client_stream_takes_only_the_genuine_events(client, counted) -> None:
    handle = hold(client)
    out = SUBJECTS.out(GW, "r1")
    await client._on_event(msg(out, event(text="a", seq=0)))  # binds (0, 1) to replica 0
    await client._on_event(msg(SUBJECTS.out(GW, "r2"), event(text="wrong subject", seq=1)))
    await client._on_event(msg(out, event(text="other replica", seq=1, replica=1)))
    await client._on_event(msg(out, event(text="unannounced", seq=0, attempt=2)))
    await client._on_event(msg(out, event(text="from the talker", seq=0, stage=1)))
    await client._on_event(msg(SUBJECTS.out(GW, "r9"), event(request_id="r9", text="unknown")))
    await client._on_event(msg(out, event(text="b", seq=1)))
    assert taken(handle) == [("a", 0, 1, 0), ("b", 0, 1, 1)]
    assert counted == Counter(
        {
            Rejected.SUBJECT_MISMATCH: 1,
            Rejected.WRONG_REPLICA: 1,
            Rejected.BAD_ATTEMPT: 1,
            Rejected.BAD_STAGE: 1,
            Rejected.UNKNOWN_REQUEST: 1,
        }
    )
    client.release("r1")
    await client._on_event(msg(out, event(text="late", seq=2)))
    assert counted[Rejected.ENDED_REQUEST] == 1


async def test_a_move_binds_the_new_attempt_to_the_replica_the_orchestrator_names(client, counted) -> None:
    handle = hold(client)
    out = SUBJECTS.out(GW, "r1")
    await client._on_event(msg(out, event(text="a", seq=0)))
    reply = Reply()
    query = ResumeQuery(request_id="r1", stage=0, attempt=2, replica=1)
    await client._on_resume(msg(SUBJECTS.resume(GW), query, reply))
    point = decode(ResumePoint, reply.data)
    assert point.known and [d.text for d in point.deltas] == ["a"]
    await client._on_event(msg(out, event(text="stale", seq=1)))  # attempt 1: fenced, counted as stale
    await client._on_event(msg(out, event(text="forged", seq=0, attempt=2, replica=0)))
    await client._on_event(msg(out, event(text="b", seq=0, attempt=2, replica=1)))
    assert taken(handle) == [("a", 0, 1, 0), ("b", 1, 2, 0)]
    assert counted == Counter({Rejected.WRONG_REPLICA: 1}) and client.stale == [0]  # type: ignore[attr-defined]


async def test_resume_questions_that_no_move_could_send_are_refused(client, counted) -> None:
    handle = hold(client)
    for query in (
        ResumeQuery(request_id="r1", stage=0, attempt=9),
        ResumeQuery(request_id="r1", stage=5, attempt=2),
        ResumeQuery(request_id="nobody", stage=0, attempt=2),
    ):
        reply = Reply()
        await client._on_resume(msg(SUBJECTS.resume(GW), query, reply))
        assert not decode(ResumePoint, reply.data).known
    assert handle.attempts.announced(0) == 1  # nothing fenced the genuine attempt off
    assert counted == Counter({Rejected.BAD_ATTEMPT: 1, Rejected.BAD_STAGE: 1, Rejected.UNKNOWN_REQUEST: 1})


async def test_a_workers_question_is_answered_with_how_far_its_attempt_got_and_a_forged_one_not_at_all(
    client, counted
) -> None:
    handle = hold(client)
    for seq in (0, 1, 3):  # 2 was lost
        await client._on_event(msg(SUBJECTS.out(GW, "r1"), event(seq=seq)))
    asked = ResumeQuery(request_id="r1", stage=0, attempt=1, replica=0)
    reply = Reply()
    await client._on_event(msg(SUBJECTS.out(GW, "r1"), asked, reply, inbox="_INBOX.w"))
    assert decode(ResumePoint, reply.data) == ResumePoint(known=True, next_seq=2)
    for forged in (asked.replace(replica=1), asked.replace(stage=1), asked.replace(request_id="r2")):
        reply = Reply()
        await client._on_event(msg(SUBJECTS.out(GW, "r1"), forged, reply, inbox="_INBOX.x"))
        assert reply.data is None
    assert counted == Counter(
        {Rejected.WRONG_REPLICA: 1, Rejected.BAD_STAGE: 1, Rejected.SUBJECT_MISMATCH: 1}
    )
    assert [e.seq for e in [handle.queue.get_nowait() for _ in range(handle.queue.qsize())]] == [0, 1]


async def test_an_unknown_status_reaches_the_client_as_502(client, counted) -> None:
    handle = hold(client)
    err = event(
        type=ClientEventType.ERROR, stage=None, replica=None, status=302, code="x", message="go to evil"
    )
    await client._on_event(msg(SUBJECTS.out(GW, "r1"), err))
    got = handle.queue.get_nowait()
    assert (got.status, got.code) == (502, "bad_status") and "evil" not in got.message
    assert counted == Counter({Rejected.BAD_STATUS: 1})


# --- registry records ------------------------------------------------------------------------
def worker(stage: int = 0, replica: int = 0, **fields) -> ServiceRecord:
    base = {
        "service": ServiceKind.WORKER,
        "pipeline": PIPELINE.name,
        "instance": "w",
        "stage": stage,
        "replica": replica,
        "stage_name": PIPELINE.stages[stage].name if 0 <= stage < 3 else "x",
        "metrics_url": "http://10.0.0.5:9100/metrics",
    }
    return ServiceRecord(**{**base, **fields})


@pytest.mark.parametrize(
    ("key", "rec", "why"),
    [
        ("worker.trust.0.1", worker(0, 1), None),
        ("worker.trust.2.1", worker(2, 1), None),
        ("worker.other.0.7", worker(0, 7, pipeline="other"), None),  # another pipeline: key only
        ("worker.trust.0.0", worker(0, 1), "its fields name worker.trust.0.1"),
        ("worker.trust.0.7", worker(0, 7), "declares 2 replica(s)"),
        ("worker.trust.1.1", worker(1, 1), "declares 1 replica(s)"),
        ("worker.trust.5.0", worker(5, 0), "stage 5 is not declared"),
        ("worker.trust.0.0", worker(0, 0, stage_name="talker"), "is thinker, not talker"),
        ("worker.trust.0.0", worker(0, 0, metrics_url="http://u:p@h:1/metrics"), "credentials"),
        ("worker.trust.0.0", worker(0, 0, metrics_url="http://h/metrics"), "no port"),
        ("worker.trust.0.0", worker(0, 0, metrics_url="file:///etc/passwd"), "not http"),
        ("gateway.trust.g1", ServiceRecord(service="gateway", pipeline="trust", instance="g2"), "its fields"),
        ("gateway.trust.g1", ServiceRecord(service="gateway", pipeline="trust", instance="g1"), None),
    ],
)
def test_a_record_is_used_only_when_it_matches_its_key_and_a_declared_replica(key, rec, why) -> None:
    got = record_problem(key, rec, PIPELINE)
    assert (got is None) if why is None else (got is not None and why in got), got


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://10.0.0.5:9100/metrics", True),
        ("https://gw.internal:8001/metrics", True),
        ("http://[::1]:8001/metrics", True),
        ("http://user@h:1/metrics", False),
        ("http://h:notaport/metrics", False),
        ("http://:1/metrics", False),
        ("gopher://h:1/", False),
        ("http://h:1/metrics?x=1", False),
        ("http://h:1/m etrics", False),
    ],
)
def test_metrics_urls_prometheus_may_be_sent_to(url, ok) -> None:
    assert (metrics_url_problem(url) is None) == ok


def test_the_registry_view_drops_and_counts_what_does_not_pass() -> None:
    seen: list[tuple[Rejected, str]] = []
    view = LiveServices(None, PIPELINE.name, config=PIPELINE, on_rejected=lambda r, k: seen.append((r, k)))  # type: ignore[arg-type]
    good = worker(0, 1)
    assert view.accept("worker.trust.0.1", good.model_dump_json().encode()) == good
    view._entries["worker.trust.0.1"] = (good, time.monotonic())
    # the key's next value is forged: what it held goes too
    assert (
        view.accept(
            "worker.trust.0.1", worker(0, 1, metrics_url="http://a:b@h:1/").model_dump_json().encode()
        )
        is None
    )
    assert view.accept("worker.trust.0.7", worker(0, 7).model_dump_json().encode()) is None
    assert view.accept("worker.trust.0.0", b"{not json") is None
    assert view.live() == []
    assert seen == [
        (Rejected.BAD_RECORD, k) for k in ("worker.trust.0.1", "worker.trust.0.7", "worker.trust.0.0")
    ]


def test_service_discovery_lists_no_target_prometheus_must_not_be_sent_to() -> None:
    records = [
        worker(0, 0),
        worker(0, 1, metrics_url="http://u:p@evil:1/metrics"),
        worker(2, 0, metrics_url=""),
    ]
    assert [g["targets"] for g in sd_targets(records)] == [["10.0.0.5:9100"]]


# --- the counter ------------------------------------------------------------------------------
@pytest.mark.parametrize("exporter", [Exporter.GATEWAY, Exporter.ORCHESTRATOR])
def test_the_family_is_exported_by_the_gateway_and_the_orchestrator_with_every_reason_at_zero(
    exporter,
) -> None:
    reg = CollectorRegistry()
    count = rejection_counter(MetricSet(exporter, True, registry=reg), "m")
    sample = f"{REJECTED_FAMILY}_total"
    assert all(reg.get_sample_value(sample, {"model_name": "m", "reason": r.value}) == 0 for r in Rejected)
    count(Rejected.WRONG_REPLICA)
    count(Rejected.WRONG_REPLICA)
    assert reg.get_sample_value(sample, {"model_name": "m", "reason": "wrong_replica"}) == 2
    assert (
        rejection_counter(MetricSet(exporter, False, registry=CollectorRegistry()), "m")(Rejected.BAD_STAGE)
        is None
    )
