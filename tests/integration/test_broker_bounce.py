"""The broker's own faults while ONE thinker replica streams every request.

``nats-server`` killed (SIGKILL) and started again on the same store 2 s later. Real gateway, orchestrator and thinker worker on a server of the
test's own. The worker must neither fail a request because a publish could not go out during the
outage (its record would show a second attempt) nor leave a gap: every stream completes in the
thinker's first attempt with exactly the tokens of the same request without a fault, and no client
waits longer than :data:`RECOVERY_LIMIT_S` once the broker is back.

``nats-server`` stopped (SIGSTOP) for longer than the stage's ``stall_timeout_s``: every replica is
silent meanwhile, and none is to blame. The orchestrator sees its own round trips through the
broker go unanswered and judges no replica; every stream completes in one attempt with the fault-free tokens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError
from openai import AsyncOpenAI

from benchmarks.chat_streams import Seen, send
from libs.common.bus import bucket_keys, connect, evictions_kv
from libs.common.subjects import EVICTIONS_BUCKET, Subjects
from libs.stack.bus_state import request_record
from libs.stack.local_nats import client_urls
from libs.stack.processes import until
from tests.conftest import NatsServer
from tests.e2e.test_replica_death import PROMPT
from tests.nats_cluster import node_of
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, gone, kill_confirmed, process_state, stop_confirmed, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "bounce"
CLUSTER_PIPELINE = "leaderkill"
STREAMS, MAX_TOKENS = 8, 1900
MIDWAY_TOKENS = 1
"""Every stream has at least this many tokens at its client when the broker dies: the streams
are under way. The client may read far behind the server on a loaded box (in one full-suite run
it had 140 tokens while the thinker had sent all 1900), so whether the fault hit the thinker's
work is proven afterwards from the records (stage 0 ended after the broker was back)."""
LEAD_TOKENS = 100
"""... or one stream has this many (the client reads the streams unevenly: in a full run the last
stream's first token came when the others had 286-391 and the thinker had finished all of them)."""
STALL_TIMEOUT_S = 2.5
"""The thinker's ``stall_timeout_s``, seconds: shorter than :data:`STOPPED_S`, so that only the
broker proof keeps the replica unjudged, including while what it buffered through the stop goes
out ahead of its probe answers (2.9 s after the broker was back, in one CI run)."""
STOPPED_S = 5.0
"""How long the broker stays stopped, seconds (under the registry's 6 s heartbeat TTL)."""
DOWN_S = 2.0
"""How long the broker stays down, seconds."""
RECOVERY_LIMIT_S = 5.0
"""How long after the broker is back (its client port open again) every stream must have its
next chunk, seconds. Judged from the restart, not as the whole pause: how long the test's own
nats-server takes to start on a loaded box is not the system's doing. Issue 18's target is 3 s
(a 5 s pause with the 2 s outage); measured 0.22 s, ~2.7 s (inside the full suite) and 3.19 s
(once, right after the server had taken 3.4 s to open its port again): the test asserts what
separates recovery from waiting for a timeout, the benchmarks judge the target."""
CLIENT_TIMEOUT_S = 180.0
"""The client's own timeout per request, seconds."""


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("bounce") / "jetstream")
    server.start()
    yield server
    server.stop()


def _services(nats_url: str, pipeline: str, tmp_path, stages_yaml: str = THINKER_YAML) -> Services:
    """An orchestrator, a gateway and ONE thinker worker of ``pipeline`` on ``nats_url`` (one
    server or every server of a cluster), started."""
    path = write_pipeline(tmp_path / "p.yaml", pipeline, stages_yaml, timeout_s=120)
    return Services(nats_url, path, tmp_path).start(
        workers=[(0, 0)], worker_env={"VLLM_CPU_KVCACHE_SPACE": "1"}
    )


@pytest.fixture(scope="module")
def bounce_stack(own_nats, tmp_path_factory) -> Iterator[Services]:
    """The stack of the broker's faults (one engine start for the module's tests)."""
    stages = THINKER_YAML + f"    stall_timeout_s: {STALL_TIMEOUT_S}\n"
    with _services(
        own_nats.url, PIPELINE, tmp_path_factory.mktemp("bouncestack"), stages
    ).serving() as services:
        yield services


async def _routed(client: AsyncOpenAI, model: str, max_tokens: int = 8) -> list[int]:
    """The greedy tokens of the streams' prompt, ``max_tokens`` of them, asked until the stack
    routes (a fresh stack's registry views may not have its worker yet)."""
    seen = Seen()
    for _ in range(60):
        seen = Seen()
        await send(client, model, seen, PROMPT, max_tokens)
        if seen.error is None:
            return seen.token_ids
        await asyncio.sleep(0.5)
    raise AssertionError(f"the request failed: {seen.error}")


@pytest.fixture(scope="module")
def reference(bounce_stack: Services) -> list[int]:
    """The streams' tokens without a fault: the greedy answer of the tiny thinker the module's
    stacks all run (one request of ``MAX_TOKENS``, asked once for the module's tests)."""

    async def ask() -> list[int]:
        client = bounce_stack.client(CLIENT_TIMEOUT_S)
        try:
            return await _routed(client, f"{PIPELINE}-model", MAX_TOKENS)
        finally:
            await client.close()

    tokens = asyncio.run(ask())
    assert len(tokens) == MAX_TOKENS
    return tokens


def _longest_pause(seen: Seen, down: float) -> float:
    """The longest wait between two chunks of ``seen`` around the outage (started at ``down``,
    ``time.monotonic()``), seconds."""
    gaps = [b - a for a, b in zip(seen.at, seen.at[1:], strict=False) if b >= down]
    return max(gaps, default=0.0)


async def _stage0_done(nats_url: str, request_id: str, timeout_s: float = 10.0) -> dict:
    """``request_id``'s record once it says the thinker finished it (a little after the client has
    the last token)."""

    async def done() -> dict | None:
        rec = None
        # After a node's death the bucket's own stream may still be electing its leader (503).
        with contextlib.suppress(ServiceUnavailableError, NatsTimeoutError):
            rec = await request_record(nats_url, request_id)
        return rec if rec and rec["stages"][0]["done_ns"] else None

    return await until(done, f"request {request_id}: stage 0 done in its record", timeout_s, every_s=0.2)


def _in_one_attempt(rec: dict) -> bool:
    """Whether the thinker's first attempt finished the request: nothing failed it or moved it."""
    return [a["attempt"] for a in rec["stages"][0]["attempts"]] in ([], [1])


async def _streams_under_way(client: AsyncOpenAI, model: str) -> tuple[list[Seen], list[asyncio.Task[None]]]:
    """``STREAMS`` streams of ``MAX_TOKENS``, returned once every one is admitted and under way
    (``MIDWAY_TOKENS`` each, or ``LEAD_TOKENS`` in one)."""
    seen = [Seen() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(send(client, model, s, PROMPT, MAX_TOKENS)) for s in seen]

    def under_way() -> bool:
        if all(s.id for s in seen) and (  # every stream admitted (its first chunk came)
            all(len(s.token_ids) >= MIDWAY_TOKENS for s in seen)
            or any(len(s.token_ids) >= LEAD_TOKENS for s in seen)
        ):
            return True
        assert not any(t.done() for t in tasks), [str(s.error) for s in seen]
        return False

    what = f"{STREAMS} streams admitted, each {MIDWAY_TOKENS} tokens in or one {LEAD_TOKENS}"
    await until(under_way, what, 60, every_s=0.02)
    return seen, tasks


async def test_streams_on_one_replica_survive_a_broker_restart(own_nats, bounce_stack, reference) -> None:
    model = f"{PIPELINE}-model"
    client = bounce_stack.client(CLIENT_TIMEOUT_S)
    await _routed(client, model)
    seen, tasks = await _streams_under_way(client, model)
    at_kill = [len(s.token_ids) for s in seen]
    killed_ns = time.time_ns()
    pid = own_nats.proc.pid
    own_nats.proc.send_signal(signal.SIGKILL)
    own_nats.proc.wait(5)
    down = time.monotonic()
    assert gone(pid), "nats-server still runs"
    await asyncio.sleep(DOWN_S)
    own_nats.start()  # the same ports, the same store
    back, back_ns = time.monotonic(), time.time_ns()
    await asyncio.wait_for(asyncio.gather(*tasks), 150)
    await client.close()
    pauses = [_longest_pause(s, down) for s in seen]
    # A stream whose client had been sent every event before the kill reads them all while the
    # broker is down (the client reads behind the server): it needed nothing after the restart.
    recovered = [min(t for t in s.at if t >= back) - back for s in seen if s.at[-1] >= back]
    print(
        f"tokens at the kill {at_kill}; broker back {back - down:.2f} s after the kill; next chunk "
        f"{[round(r, 2) for r in recovered]} s after that; longest pauses {[round(p, 2) for p in pauses]} s"
    )
    assert [str(s.error) for s in seen if s.error] == []
    # The fault hit the thinker's work: it had not finished every stream when the broker died,
    # and those it had not finished it finished only after the broker was back (it waited).
    records = [await _stage0_done(own_nats.url, s.id) for s in seen]
    done = [rec["stages"][0]["done_ns"] for rec in records]
    cut = [d for d in done if d > killed_ns]
    print(f"streams the thinker finished after the kill: {len(cut)} of {STREAMS}")
    assert cut, "the thinker had finished every stream before the kill: the fault missed"
    assert all(d > back_ns for d in cut), (killed_ns, back_ns, done)
    for s in seen:
        assert s.token_ids == reference, (len(s.token_ids), s.id)
        assert s.usage_tokens == MAX_TOKENS and s.finish_reason == "length"
    assert max(recovered, default=0.0) <= RECOVERY_LIMIT_S, recovered
    assert all(_in_one_attempt(rec) for rec in records), [rec["stages"][0] for rec in records]


async def test_a_stopped_broker_gets_no_replica_judged(own_nats, bounce_stack, reference) -> None:
    model = f"{PIPELINE}-model"
    client = bounce_stack.client(CLIENT_TIMEOUT_S)
    await _routed(client, model)
    judged_before = await _judged(own_nats.url)
    seen, tasks = await _streams_under_way(client, model)
    pid = own_nats.proc.pid
    try:
        await stop_confirmed(pid, "nats-server")
        stopped_ns = time.time_ns()
        await asyncio.sleep(STOPPED_S)  # the fault's length: nothing to wait for but time
        assert process_state(pid) == "T", "nats-server ran again before SIGCONT"
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed_ns = time.time_ns()
    await asyncio.wait_for(asyncio.gather(*tasks), 150)
    await client.close()
    assert [str(s.error) for s in seen if s.error] == []
    # The fault hit the thinker's work: streams it finished (its own clock, in the stage_done
    # event) after the broker stopped, whose records stayed open for the whole silence (nothing
    # reaches the bucket while the broker is stopped). The thinker may well finish them during
    # the silence: its events wait in its socket and buffer.
    records = [await _stage0_done(own_nats.url, s.id) for s in seen]
    done = [rec["stages"][0]["done_ns"] for rec in records]
    assert any(d > stopped_ns for d in done), (stopped_ns, resumed_ns, done)
    for s in seen:
        assert s.token_ids == reference, (len(s.token_ids), s.id)
    assert all(_in_one_attempt(rec) for rec in records), [rec["stages"][0] for rec in records]
    assert await _judged(own_nats.url) == judged_before, "a replica was judged dead for the broker's silence"


async def _judged(nats_url: str) -> set[str]:
    """The replica deaths judged so far: the keys of ``omni_evictions``."""
    nc = await connect(nats_url, "bounce-test")
    try:
        await evictions_kv(nc.jetstream())
        return await bucket_keys(nc, EVICTIONS_BUCKET)
    finally:
        await nc.close()


async def test_an_admission_the_broker_lost_is_sent_again_when_the_gateway_reconnects(
    own_nats, bounce_stack
) -> None:
    """The requests stream acknowledges a write before it is on disk (persist mode ``async``), so
    a broker killed just after may come back without an admission it acknowledged. No kill can be
    timed into that window, so the loss is made: with the orchestrator killed (so that no pull of
    its holds a copy), a request's admission waits in the stream; the stream is purged (the loss)
    and the broker stopped and started again. The gateway sends the admission again when it
    reconnects, and the request completes once an orchestrator runs again (without that, it would
    wait out its 120 s deadline)."""
    model = f"{PIPELINE}-model"
    subjects = Subjects(PIPELINE)
    client = bounce_stack.client(CLIENT_TIMEOUT_S)
    await _routed(client, model)
    await kill_confirmed(bounce_stack.orchestrator.proc.pid, "the orchestrator")
    asked = asyncio.create_task(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "lost"}], max_tokens=8, temperature=0
        )
    )
    nc = await connect(own_nats.url, "bounce-test")
    js = nc.jetstream()

    async def waiting() -> int:
        return (await js.stream_info(subjects.requests_stream)).state.messages

    await until(waiting, "the admission waiting in the requests stream", 30)
    await js.purge_stream(subjects.requests_stream)
    assert await waiting() == 0, "the admission is still there"
    await nc.close()
    pid = own_nats.proc.pid
    own_nats.stop()
    assert gone(pid), "nats-server still runs"
    own_nats.start()  # the same ports, the same store
    nc = await connect(own_nats.url, "bounce-test")
    js = nc.jetstream()
    try:
        assert await until(waiting, "the admission sent again", 30) == 1
    finally:
        await nc.close()
    assert not asked.done(), "the request ended while its admission was lost"
    bounce_stack.orchestrator.start()  # the orchestrator again
    await bounce_stack.ready()
    answer = await asyncio.wait_for(asked, 90)
    await client.close()
    assert answer.usage.completion_tokens == 8 and answer.choices[0].finish_reason == "length"


@pytest.fixture
def cluster_stack(cluster, tmp_path) -> Iterator[Services]:
    """The same services on a 3-node cluster, each given every server's URL (as ``omnirelay up
    --nats-nodes 3`` and compose give them): streams and buckets get 3 replicas."""
    with _services(client_urls([n.spec for n in cluster]), CLUSTER_PIPELINE, tmp_path).serving() as services:
        yield services


async def test_streams_on_one_replica_survive_the_death_of_the_stream_leader(
    cluster, cluster_stack, reference
) -> None:
    """Issue 18's cluster row: ``kill -9`` of the node that leads the stage streams while ONE
    thinker replica streams every request. The cluster elects a new leader; every client, KV and
    stream goes on through the other two nodes, and every stream completes with exactly the
    fault-free tokens."""
    model = f"{CLUSTER_PIPELINE}-model"
    client = cluster_stack.client(CLIENT_TIMEOUT_S)
    await _routed(client, model)
    nc = await connect(cluster_stack.nats_url, "test")
    try:
        info = await nc.jetstream().stream_info(Subjects(CLUSTER_PIPELINE).stages_stream)
    finally:
        await nc.close()
    victim = node_of(cluster, info.cluster.leader)
    seen, tasks = await _streams_under_way(client, model)
    killed_ns = time.time_ns()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(5)
    down = time.monotonic()
    assert gone(victim.proc.pid), f"{victim.spec.name} still runs"
    await asyncio.wait_for(asyncio.gather(*tasks), 150)
    await client.close()
    pauses = [_longest_pause(s, down) for s in seen]
    print(
        f"killed {victim.spec.name} (the stages stream's leader); longest pauses {[round(p, 2) for p in pauses]} s"
    )
    assert [str(s.error) for s in seen if s.error] == []
    survivors = ",".join(n.spec.url for n in cluster if n is not victim)
    records = [await _stage0_done(survivors, s.id) for s in seen]
    assert any(rec["stages"][0]["done_ns"] > killed_ns for rec in records), (
        "the thinker had finished every stream before the kill"
    )
    for s in seen:
        assert s.token_ids == reference, (len(s.token_ids), s.id)
        assert s.usage_tokens == MAX_TOKENS and s.finish_reason == "length"
    assert all(_in_one_attempt(rec) for rec in records), [rec["stages"][0] for rec in records]
