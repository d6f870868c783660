"""On one server the requests stream is declared in persist mode ``async`` (it acknowledges before
its write is on disk; the gateway sends an admission again after a reconnect), the other streams
in the default mode. JetStream fixes the mode when it creates a stream, so a requests stream made
before in the default mode is made anew only while nothing uses it, against a real nats-server."""

from __future__ import annotations

import nats
import pytest
from nats.js.api import ConsumerConfig, PersistMode, RetentionPolicy, StreamConfig

from libs.common.bus import ensure_topology
from libs.common.subjects import Subjects

pytestmark = pytest.mark.integration


async def _modes(js, subjects: Subjects) -> dict[str, str | None]:
    names = (subjects.requests_stream, subjects.stages_stream, subjects.events_stream)
    return {n: (await js.stream_info(n)).config.persist_mode for n in names}


async def test_only_the_requests_stream_is_async(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        subjects = Subjects("modes")
        await ensure_topology(nc.jetstream(), subjects)
        await ensure_topology(nc.jetstream(), subjects)  # a second service's declaration changes nothing
        assert await _modes(nc.jetstream(), subjects) == {
            subjects.requests_stream: PersistMode.ASYNC,
            subjects.stages_stream: None,
            subjects.events_stream: None,
        }
    finally:
        await nc.close()


@pytest.mark.parametrize("in_use", [False, True])
async def test_a_requests_stream_made_before_is_made_anew_only_when_unused(nats_server, in_use) -> None:
    subjects = Subjects(f"before{int(in_use)}")
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=subjects.requests_stream,
                subjects=[subjects.requests],
                retention=RetentionPolicy.WORK_QUEUE,
            )
        )
        if in_use:
            await js.add_consumer(subjects.requests_stream, ConsumerConfig(durable_name="orchestrator"))
            await js.publish(subjects.requests, b"waiting")
        await ensure_topology(js, subjects)
        info = await js.stream_info(subjects.requests_stream)
        if in_use:  # kept, with what it holds
            assert (info.config.persist_mode, info.state.messages, info.state.consumer_count) == (None, 1, 1)
            assert info.config.max_msgs == 10_000  # the rest of the declaration applied
        else:
            assert info.config.persist_mode == PersistMode.ASYNC
    finally:
        await nc.close()
