"""How ``libs.common.bus`` finds or creates a KV bucket when JetStream is slow to answer. A client
connected to two nodes of a three-node cluster once took a timed-out look-up for a missing bucket
and created it with two replicas over the cluster's three: "stream name already in use with a
different configuration" (err 10058, a CI run of 2026-11-29). A look-up timing out on demand
needs a broker stalled at the right moment, so JetStream is scripted here; the cluster itself is
``tests/integration/test_broker_bounce.py``.

A three-node cluster whose metadata leader was just elected may answer a stream's creation with
"no suitable peers for placement" (err 10005, a full-suite run of 2026-12-06): on demand that
needs a cluster caught in its first moment, so that answer is scripted too.

A bucket's key listing comes in pages of 100,000 keys; so many keys are not written for a unit
test, so the pages are scripted too (the listing itself is ``tests/integration/test_bucket_keys.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError, ServiceUnavailableError

from libs.common import bus
from libs.common.bus import TOPOLOGY_TRIES, bucket_keys, ensure_topology, requests_kv
from libs.common.subjects import Subjects


class _Client:
    """Stands for the nats-py client of a context made outside ``bus.connect``."""


@dataclass
class ScriptedJetStream:
    """Answers each ``key_value`` look-up with the next of ``answers`` (an exception is raised)
    and counts the creates."""

    answers: list[object]
    looked_up: int = 0
    created: list[object] = field(default_factory=list)
    _nc: _Client = field(default_factory=_Client)
    """Where nats-py keeps a context's client (``bus.replicas`` looks it up: none known, 1)."""

    async def key_value(self, bucket: str) -> object:
        answer = self.answers[self.looked_up]
        self.looked_up += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def create_key_value(self, config: object) -> str:
        self.created.append(config)
        return "created"


async def test_a_look_up_that_timed_out_is_made_again_and_creates_nothing() -> None:
    js = ScriptedJetStream([NatsTimeoutError(), NatsTimeoutError(), "the bucket"])
    assert await requests_kv(js) == "the bucket"  # type: ignore[arg-type]
    assert (js.looked_up, js.created) == (3, [])


async def test_a_look_up_that_never_answers_raises_and_creates_nothing() -> None:
    js = ScriptedJetStream([NatsTimeoutError()] * TOPOLOGY_TRIES)
    with pytest.raises(NatsTimeoutError):
        await requests_kv(js)  # type: ignore[arg-type]
    assert (js.looked_up, js.created) == (TOPOLOGY_TRIES, [])


async def test_a_stream_without_a_leader_raises_and_creates_nothing() -> None:
    js = ScriptedJetStream([ServiceUnavailableError(code=503, err_code=10008, description="no leader")])
    with pytest.raises(ServiceUnavailableError):
        await requests_kv(js)  # type: ignore[arg-type]
    assert js.created == []


async def test_only_a_bucket_jetstream_says_it_lacks_is_created() -> None:
    js = ScriptedJetStream([NatsTimeoutError(), BucketNotFoundError()])
    assert await requests_kv(js) == "created"  # type: ignore[arg-type]
    (config,) = js.created
    assert config.bucket == "omni_requests" and config.replicas == 1  # a client made outside connect()


def _no_peers() -> BadRequestError:
    return BadRequestError(code=400, err_code=10005, description="no suitable peers for placement")


@dataclass
class FormingCluster:
    """Answers the first ``refusals`` stream creations with :func:`_no_peers`, then creates; has
    no stream and no bucket before."""

    refusals: int
    streams: list[str] = field(default_factory=list)
    looked_up: list[str] = field(default_factory=list)
    _nc: _Client = field(default_factory=_Client)

    async def add_stream(self, config: object) -> None:
        if self.refusals:
            self.refusals -= 1
            raise _no_peers()
        self.streams.append(config.name)

    async def stream_info(self, name: str) -> object:
        self.looked_up.append(name)
        raise NotFoundError(code=404, err_code=10059, description="stream not found")

    async def key_value(self, bucket: str) -> object:
        raise BucketNotFoundError()

    async def create_key_value(self, config: object) -> str:
        return "created"


async def test_a_stream_a_forming_cluster_cannot_place_yet_is_created_once_it_can(monkeypatch) -> None:
    monkeypatch.setattr(bus, "PLACEMENT_RETRY_S", 0.01)
    subjects = Subjects("text")
    js = FormingCluster(refusals=2)
    await ensure_topology(js, subjects)  # type: ignore[arg-type]
    assert js.streams == [subjects.requests_stream, subjects.stages_stream, subjects.events_stream]
    assert not set(js.looked_up) & set(js.streams), "a refused creation was taken for a stream that exists"


async def test_a_cluster_that_never_places_the_stream_fails_the_declaration(monkeypatch) -> None:
    monkeypatch.setattr(bus, "PLACEMENT_RETRY_S", 0.01)
    monkeypatch.setattr(bus, "PLACEMENT_WAIT_S", 0.1)
    js = FormingCluster(refusals=10**6)
    with pytest.raises(BadRequestError) as refused:
        await ensure_topology(js, Subjects("text"))  # type: ignore[arg-type]
    assert refused.value.err_code == 10005 and js.streams == []


@dataclass
class ScriptedPages:
    """Answers each stream-info request with the next page of ``subjects`` (``limit`` at a time),
    as the server does when asked for a subject filter: ``total``, ``offset``, and the page."""

    subjects: list[str]
    limit: int
    asked: list[dict] = field(default_factory=list)

    async def request(self, subject: str, payload: bytes, timeout: float) -> SimpleNamespace:
        asked = json.loads(payload)
        self.asked.append(asked | {"subject": subject})
        page = self.subjects[asked["offset"] : asked["offset"] + self.limit]
        answer = {"total": len(self.subjects), "offset": asked["offset"], "state": {}}
        if page:
            answer["state"]["subjects"] = dict.fromkeys(page, 1)
        return SimpleNamespace(data=json.dumps(answer).encode())


async def test_a_listing_reads_every_page() -> None:
    nc = ScriptedPages([f"$KV.omni_requests.r{i}" for i in range(5)], limit=2)
    assert await bucket_keys(nc, "omni_requests") == {f"r{i}" for i in range(5)}  # type: ignore[arg-type]
    assert [a["offset"] for a in nc.asked] == [0, 2, 4]
    assert {(a["subject"], a["subjects_filter"]) for a in nc.asked} == {
        ("$JS.API.STREAM.INFO.KV_omni_requests", "$KV.omni_requests.>")
    }


async def test_a_listing_of_a_bucket_that_lost_keys_meanwhile_ends() -> None:
    """Keys that expired between two pages shrink the total: the listing ends on an empty page."""
    nc = ScriptedPages([f"$KV.omni_services.s{i}" for i in range(3)], limit=2)

    async def shrinking(subject: str, payload: bytes, timeout: float) -> SimpleNamespace:
        answer = await ScriptedPages.request(nc, subject, payload, timeout)
        del nc.subjects[-1:]  # one key expires after each answer
        return answer

    nc.request = shrinking  # type: ignore[method-assign]
    assert await bucket_keys(nc, "omni_services") == {"s0", "s1"}  # type: ignore[arg-type]
