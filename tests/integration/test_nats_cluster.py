"""A 3-node JetStream cluster of real nats-servers (``libs.stack.local_nats``, ``sync_interval``
``always``): the pipeline's streams and KV buckets get 3 replicas, and ``kill -9`` of the leader of
a work-queue stream while messages are published and consumed loses no acknowledged message and
delivers none twice; clients given every server URL go on, KV included.

Clocks: ``time.monotonic()`` of this process, seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.js.errors import NoStreamResponseError

from libs.common.bus import connect, ensure_topology, requests_kv, server_urls
from libs.common.subjects import EVICTIONS_BUCKET, REQUESTS_BUCKET, SERVICES_BUCKET, Subjects
from libs.stack.local_nats import client_urls
from libs.stack.local_stack import Stack
from libs.stack.processes import until
from tests.nats_cluster import Node, node_of
from tests.procs import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

UNDER_LOAD = 50
"""The kill comes once this many messages have been acknowledged and consumed, and publishing
stops once this many more sent after the kill have been acknowledged and consumed."""
LOAD_TIMEOUT_S = 30.0
"""... each within this long, seconds."""
DRAIN_TIMEOUT_S = 30.0
"""Every acknowledged message must be consumed this long after publishing stops, seconds."""
PUBLISHERS = 4
ACK_WAIT_S = 2.0
"""The consumer's redelivery timer, seconds."""


async def test_topology_gets_a_replica_on_every_server_and_scales_what_exists(cluster: list[Node]) -> None:
    subjects = Subjects("clustered")
    # A client given one server declares single-replica streams and buckets (as on one server)...
    one = await connect(cluster[0].spec.url, "one-url")
    await ensure_topology(one.jetstream(), subjects)
    assert (await one.jetstream().stream_info(subjects.stages_stream)).config.num_replicas == 1
    # ... whose buckets answer reads by direct get (one replica: no follower can lag) ...
    for b in (SERVICES_BUCKET, REQUESTS_BUCKET, EVICTIONS_BUCKET):
        assert (await one.jetstream().stream_info(f"KV_{b}")).config.allow_direct is True, b
    kv = await one.jetstream().key_value(REQUESTS_BUCKET)
    # A stream just created on one node of a cluster is not heard on every node at once: a write
    # may meet "no responders" for a moment, which nats-py raises as "no response from stream" (a
    # service's write is tried again when that happens: libs/common/publish.py).

    async def created() -> bool:
        try:
            await kv.create("r1", b"{}")
            return True
        except NoStreamResponseError:
            return False

    await until(created, "the new bucket taking a write", 10.0, every_s=0.1)
    assert (await kv.get("r1")).value == b"{}"
    await one.close()
    # ... a client given every server scales them to 3.
    nc = await connect(client_urls([n.spec for n in cluster]), "all-urls")
    try:
        js = nc.jetstream()
        await ensure_topology(js, subjects)
        names = [subjects.requests_stream, subjects.stages_stream, subjects.events_stream]
        names += [f"KV_{b}" for b in (SERVICES_BUCKET, REQUESTS_BUCKET, EVICTIONS_BUCKET)]
        infos = {name: await js.stream_info(name) for name in names}
        for name, info in infos.items():
            assert info.config.num_replicas == 3, name
            # a follower's direct-get answer could lag what its leader acknowledged
            assert not info.config.allow_direct, name

        async def peers_added() -> bool:  # the servers add the new peers after the update returns
            for name, info in infos.items():
                if len(info.cluster.replicas or []) < 2:
                    infos[name] = await js.stream_info(name)
            return all(len(info.cluster.replicas or []) >= 2 for info in infos.values())

        await until(peers_added, f"two followers of each of {names}", 10.0, every_s=0.1)
        for name, info in infos.items():
            assert info.cluster.leader and len(info.cluster.replicas or []) == 2, f"{name}: {info.cluster}"
    finally:
        await nc.close()


@dataclass
class Load:
    """What the clients saw: ids acknowledged by the stream, ids consumed (in order, repeats kept)."""

    acked: set[str] = field(default_factory=set)
    acked_after_kill: int = 0
    first_ack_after_kill_s: float | None = None
    """``time.monotonic()`` of the first acknowledgement of a publish sent after the kill."""
    publish_retries: int = 0
    consumed: list[str] = field(default_factory=list)
    unconfirmed_acks: set[str] = field(default_factory=set)
    """Consumed ids whose ``ack_sync`` got no confirmation (the server may deliver them again)."""


async def _publish(
    js: JetStreamContext, subject: str, prefix: str, load: Load, stop: asyncio.Event, kill: asyncio.Event
) -> None:
    """Publish ``<prefix>-<n>`` one after another until ``stop``; a publish with no
    acknowledgement (the leader is gone, an election is under way) is sent again with the same
    ``Nats-Msg-Id``, so the stream keeps one copy."""
    n = 0
    while not stop.is_set():
        msg_id, sent_after_kill = f"{prefix}-{n}", kill.is_set()
        while True:
            try:
                await js.publish(subject, msg_id.encode(), timeout=2.0, headers={"Nats-Msg-Id": msg_id})
                break
            except Exception:  # no responders, timeout, cluster error: all mean "not stored yet"
                load.publish_retries += 1
                await asyncio.sleep(0.1)
        load.acked.add(msg_id)
        if sent_after_kill:
            load.acked_after_kill += 1
            load.first_ack_after_kill_s = load.first_ack_after_kill_s or time.monotonic()
        n += 1


async def _consume(js: JetStreamContext, stream: str, subject: str, load: Load, done: asyncio.Event) -> None:
    """Fetch and ``ack_sync`` until ``done``; a message whose ack did not take is delivered again
    :data:`ACK_WAIT_S` later."""
    config = ConsumerConfig(ack_wait=ACK_WAIT_S)
    sub = await js.pull_subscribe(subject, durable="cluster-test", stream=stream, config=config)
    while not done.is_set():
        try:
            msgs = await sub.fetch(64, timeout=0.5)
        except Exception:  # nothing waiting, or the consumer's leader is moving
            continue
        for msg in msgs:
            load.consumed.append(msg.data.decode())
            try:
                await msg.ack_sync(timeout=2.0)
            except Exception:
                load.unconfirmed_acks.add(msg.data.decode())


async def test_kill_9_of_the_stream_leader_under_load_loses_nothing(cluster: list[Node]) -> None:
    subjects = Subjects("clustered")
    urls = client_urls([n.spec for n in cluster])
    nc = await connect(urls, "consumer")  # the services' way: every URL, any server
    js = nc.jetstream()
    await ensure_topology(js, subjects)
    stream, subject = subjects.stages_stream, subjects.stage_in(0, 0)
    leader = (await js.stream_info(stream)).cluster.leader
    victim = node_of(cluster, leader)
    # The publisher is connected to the leader itself (listed first, no shuffling), so its
    # connection dies with it and it must go on through another server.
    others = [n.spec.url for n in cluster if n is not victim]
    pub_nc: NATS = await nats.connect(
        servers=[victim.spec.url, *others],
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
    )
    assert pub_nc.connected_url.port == victim.spec.port
    kv = await requests_kv(js)

    async def stored_before() -> bool:
        """The bucket, just made with three replicas, takes writes once its leader is elected."""
        with contextlib.suppress(nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
            await kv.put("before", b"1")
            return True
        return False

    await until(stored_before, "the new bucket's first write", timeout_s=30)

    load, stop, kill, done = Load(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    pub_js = pub_nc.jetstream()
    publishers = [
        asyncio.create_task(_publish(pub_js, subject, f"p{i}", load, stop, kill)) for i in range(PUBLISHERS)
    ]
    consumer = asyncio.create_task(_consume(js, stream, subject, load, done))
    try:
        await until(
            lambda: min(len(load.acked), len(load.consumed)) >= UNDER_LOAD,
            "publishing and consuming under way",
            LOAD_TIMEOUT_S,
        )
        acked_before, consumed_before = len(load.acked), len(load.consumed)
        t_kill = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        kill.set()
        assert victim.proc.wait(5) == -signal.SIGKILL
        assert gone(victim.proc.pid)
        # The load goes on through the failover: publishes sent after the kill acknowledged by
        # the stream's new leader, and messages consumed after it.
        await until(
            lambda: (
                load.acked_after_kill >= UNDER_LOAD and len(load.consumed) >= consumed_before + UNDER_LOAD
            ),
            "publishing and consuming after the kill",
            LOAD_TIMEOUT_S,
        )
        stop.set()
        await asyncio.gather(*publishers)
        # Drained: every acknowledged id consumed and the work queue empty (every message acked;
        # one whose ack was lost in the failover is delivered again and acked then).
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        left = -1
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                left = (await js.stream_info(stream)).state.messages
            if left == 0 and load.acked <= set(load.consumed):
                break
            await asyncio.sleep(0.5)
        done.set()
        await consumer

        # The fault happened where it should: the leader died, another took over, and the
        # publisher's connection moved to a survivor.
        new_leader = (await js.stream_info(stream)).cluster.leader
        assert new_leader and new_leader != leader, new_leader
        assert pub_nc.connected_url.port != victim.spec.port
        # Nothing lost, nothing twice (but an id whose ack was never confirmed may come again).
        missing = load.acked - set(load.consumed)
        assert not missing, f"{len(missing)} acknowledged messages never consumed: {sorted(missing)[:5]}"
        repeated = {m for m in load.consumed if load.consumed.count(m) > 1}
        assert repeated <= load.unconfirmed_acks, sorted(repeated - load.unconfirmed_acks)[:5]
        assert left == 0, f"{left} messages never acked ({len(load.unconfirmed_acks)} unconfirmed acks)"

        # KV through the same client: the record written before the kill, and a new one. The
        # bucket's own stream elects its leader apart from the work queue's: a read may time out
        # while it does (in a full run the first one did), and must succeed after it.
        async def before() -> bytes | None:
            with contextlib.suppress(nats.errors.TimeoutError):
                return (await kv.get("before")).value
            return None

        assert await until(before, "the KV read after the kill", timeout_s=30) == b"1"
        await kv.put("after", b"2")
        assert (await kv.get("after")).value == b"2"
        print(
            f"\nkilled {leader} (pid {victim.proc.pid}) after {acked_before} acked; new leader {new_leader}; "
            f"{len(load.acked)} acked ({load.acked_after_kill} after the kill), "
            f"{len(load.consumed)} consumed, {len(repeated)} repeated "
            f"({len(load.unconfirmed_acks)} acks unconfirmed), "
            f"{load.publish_retries} publish retries; first publish acked "
            f"{load.first_ack_after_kill_s - t_kill:.2f} s after the kill"
        )
    finally:
        stop.set()
        done.set()
        for t in [*publishers, consumer]:
            t.cancel()
        await pub_nc.close()
        await nc.close()


@pytest.mark.parametrize("nodes", [1, 3])
async def test_the_launcher_starts_nats_with_its_sync_interval_and_stops_it(
    nodes: int, tmp_path: Path
) -> None:
    """``omnirelay up``'s NATS (``Stack.start_nats``): every server healthy with the chosen
    ``sync_interval`` (``/varz``), in a cluster of ``nodes``, and stopped with the stack."""
    stack = Stack(tmp_path)
    try:
        urls = await asyncio.to_thread(stack.start_nats, nodes, "always")
        monitors = list(stack.monitors.values())
        assert len(server_urls(urls)) == len(monitors) == nodes
        async with httpx.AsyncClient(timeout=5) as http:
            for monitor in monitors:
                varz = (await http.get(f"{monitor}/varz")).json()
                assert varz["jetstream"]["config"]["sync_always"] is True
                assert (varz.get("cluster", {}).get("name") == "omnirelay") == (nodes > 1)
        nc = await connect(urls, "launcher-test")
        await ensure_topology(nc.jetstream(), Subjects("launched"))
        info = await nc.jetstream().stream_info(Subjects("launched").stages_stream)
        assert info.config.num_replicas == nodes
        await nc.close()
    finally:
        await asyncio.to_thread(stack.stop)
    assert all(p.returncode is not None for p in stack.processes.values())
