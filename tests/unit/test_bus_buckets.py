"""How ``libs.common.bus`` finds or creates a KV bucket when JetStream is slow to answer. A client
connected to two nodes of a three-node cluster once took a timed-out look-up for a missing bucket
and created it with two replicas over the cluster's three: "stream name already in use with a
different configuration" (err 10058, a CI run of 2026-11-29). A look-up timing out on demand
needs a broker stalled at the right moment, so JetStream is scripted here; the cluster itself is
``tests/integration/test_broker_bounce.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import BucketNotFoundError, ServiceUnavailableError

from libs.common.bus import TOPOLOGY_TRIES, requests_kv


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
