"""The orchestrator against a real nats-server: admission, routing, headers, lifecycle, deadlines.

No engines are needed: the test plays the gateway (publishes admissions, listens on the out
subject) and registers worker entries in ``omni_services`` the way workers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from libs.common import headers as h
from libs.common.bus import requests_kv, services_kv
from libs.common.envelopes import (
    AbortNotice,
    Admission,
    ClientEvent,
    ClientEventType,
    LifecycleEvent,
    Liveness,
    Sampling,
    StageTask,
    TaskKind,
    decode,
)
from libs.common.publish import publish_lifecycle
from libs.common.records import RequestRecord, RequestStatus, StageProgress
from libs.common.registry import ServiceKind, ServiceRecord
from libs.common.subjects import ORCHESTRATOR_ADMISSION_CONSUMER, Subjects
from libs.stack.bus_state import barrier
from libs.stack.processes import until
from services.orchestrator.admission import MAX_CONCURRENT_ADMISSIONS
from services.orchestrator.orchestrator import HEALTH_PERIOD_S, LOOP_LAG_PERIOD_S
from tests.client_streams import until_record
from tests.metrics_scrape import Samples, delta, scrape, total
from tests.pipeline_services import Services
from tests.procs import (
    CODE2WAV_YAML,
    TALKER_YAML,
    THINKER_YAML,
    ServiceProcess,
    stop_confirmed,
    write_pipeline,
)

pytestmark = pytest.mark.integration

PIPELINE = "orchtest"
GATEWAY = "gwtest"
SUBJECTS = Subjects(PIPELINE)


@pytest.fixture(scope="module")
def orchestrator(nats_server, tmp_path_factory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("orch")
    # Two thinkers: the registry's views take records only of replicas the pipeline declares.
    thinkers = THINKER_YAML.replace("replicas: 1", "replicas: 2")
    assert thinkers != THINKER_YAML
    path = write_pipeline(tmp / "p.yaml", PIPELINE, thinkers + TALKER_YAML + CODE2WAV_YAML)
    with Services(nats_server.url, path, tmp).start(gateway=False).serving() as services:
        yield services.orchestrator


def admission(audio: bool = False, deadline_s: float = 60.0) -> Admission:
    now = time.time_ns()
    return Admission(
        request_id=f"req-{now}-{id(object())}",
        gateway_id=GATEWAY,
        arrival_ns=now,
        deadline_ns=now + int(deadline_s * 1e9),
        prompt_token_ids=[1, 2, 3],
        sampling=Sampling(max_tokens=4),
        audio=audio,
    )


async def _answer_probe(msg) -> None:
    await msg.respond(Liveness().encode())


@contextlib.asynccontextmanager
async def live_workers(nc, replicas: dict[int, list[int]]):
    """Worker entries in the registry, refreshed like heartbeats, and answers to the liveness
    probes of those replicas, while the block runs."""
    kv = await services_kv(nc.jetstream())
    probes = [
        await nc.subscribe(SUBJECTS.alive(s, r), cb=_answer_probe) for s, rs in replicas.items() for r in rs
    ]
    records = [
        ServiceRecord(
            service=ServiceKind.WORKER, pipeline=PIPELINE, instance=f"fake-{s}-{r}", stage=s, replica=r
        )
        for s, rs in replicas.items()
        for r in rs
    ]

    async def beat() -> None:
        while True:
            for rec in records:
                await kv.put(rec.key, rec.model_dump_json().encode())
            await asyncio.sleep(1)

    task = asyncio.create_task(beat())
    await asyncio.sleep(0.5)
    try:
        yield
    finally:
        task.cancel()
        for sub in probes:
            await sub.unsubscribe()
        for rec in records:
            await kv.delete(rec.key)


async def test_no_live_replica_is_answered_with_503(orchestrator, nc) -> None:
    q: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out_wildcard(GATEWAY), cb=q.put)
    adm = admission()
    await nc.jetstream().publish(SUBJECTS.requests, adm.encode())
    ev = decode(ClientEvent, (await asyncio.wait_for(q.get(), 10)).data)
    assert (ev.request_id, ev.type, ev.status, ev.code) == (
        adm.request_id,
        ClientEventType.ERROR,
        503,
        "no_live_replica",
    )
    assert "stage 0 (thinker)" in ev.message


async def test_requests_are_spread_over_live_replicas_with_every_header(orchestrator, nc) -> None:
    q: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(f"omni.{PIPELINE}.stage.>", cb=q.put)
    async with live_workers(nc, {0: [0, 1], 1: [0], 2: [0]}):
        sent = [admission(audio=True) for _ in range(10)]
        for adm in sent:
            await nc.jetstream().publish(SUBJECTS.requests, adm.encode())
        msgs = [await asyncio.wait_for(q.get(), 10) for _ in sent]
    by_replica = Counter()
    for msg in msgs:
        task = decode(StageTask, msg.data)
        hdr = msg.headers
        assert task.kind == TaskKind.START and task.seq == 0 and task.final
        assert len(task.route) == 3 and task.route[1:] == [0, 0]
        assert msg.subject == SUBJECTS.stage_in(0, task.route[0])
        assert hdr[h.REQUEST_ID] == task.request_id
        assert hdr[h.FROM_STAGE] == hdr[h.FROM_REPLICA] == h.FROM_ORCHESTRATOR
        assert (hdr[h.TO_STAGE], hdr[h.TO_REPLICA]) == ("0", str(task.route[0]))
        assert (hdr[h.SEQ], hdr[h.FINAL]) == ("0", "true")
        assert int(hdr[h.PAYLOAD_BYTES]) == len(msg.data)
        assert int(hdr[h.TX_START_NS]) <= int(hdr[h.TX_END_NS])
        assert int(hdr[h.ARRIVAL_NS]) == task.arrival_ns
        assert hdr[h.MSG_ID] == f"{task.request_id}.0.0"
        by_replica[task.route[0]] += 1
    assert by_replica == {0: 5, 1: 5}, by_replica
    assert {decode(StageTask, m.data).request_id for m in msgs} == {a.request_id for a in sent}
    kv = await requests_kv(nc.jetstream())
    rec = await until_record(kv, sent[0].request_id, lambda r: True, "written", timeout_s=5)
    assert rec.pipeline == PIPELINE and rec.status == RequestStatus.ADMITTED and len(rec.stages) == 3


async def test_lifecycle_events_update_the_record(orchestrator, nc) -> None:
    q: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(f"omni.{PIPELINE}.stage.0.>", cb=q.put)
    async with live_workers(nc, {0: [0], 1: [0], 2: [0]}):
        adm = admission()
        await nc.jetstream().publish(SUBJECTS.requests, adm.encode())
        await asyncio.wait_for(q.get(), 10)
    js = nc.jetstream()
    now = time.time_ns()
    await publish_lifecycle(
        js, SUBJECTS, LifecycleEvent(request_id=adm.request_id, kind="started", ts_ns=now, stage=0, replica=0)
    )
    await publish_lifecycle(
        js,
        SUBJECTS,
        LifecycleEvent(
            request_id=adm.request_id,
            kind="finished",
            ts_ns=now + 5,
            stage=0,
            replica=0,
            finish_reason="stop",
        ),
    )
    kv = await requests_kv(js)
    rec = await until_record(
        kv, adm.request_id, lambda r: r.status == RequestStatus.COMPLETED, "completed", timeout_s=5
    )
    assert rec.status == RequestStatus.COMPLETED and rec.finish_reason == "stop"
    assert (rec.stages[0].started_ns, rec.stages[0].done_ns) == (now, now + 5)


async def test_a_request_past_its_deadline_is_failed_aborted_and_answered(orchestrator, nc) -> None:
    out: asyncio.Queue = asyncio.Queue()
    aborts: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out_wildcard(GATEWAY), cb=out.put)
    await nc.subscribe(SUBJECTS.abort, cb=aborts.put)
    now = time.time_ns()
    rid = f"stuck-{now}"
    rec = RequestRecord(
        request_id=rid,
        pipeline=PIPELINE,
        gateway_id=GATEWAY,
        status=RequestStatus.RUNNING,
        route=[0],
        stages=[StageProgress(replica=0)],
        arrival_ns=now - 10**10,
        admitted_ns=now - 10**10,
        deadline_ns=now - 2 * 10**9,
        updated_ns=now - 10**10,
    )
    kv = await requests_kv(nc.jetstream())
    await kv.put(rid, rec.model_dump_json().encode())
    ev = decode(ClientEvent, (await asyncio.wait_for(out.get(), 10)).data)
    assert (ev.request_id, ev.type, ev.status, ev.code) == (rid, ClientEventType.ERROR, 504, "timeout")
    notice = decode(AbortNotice, (await asyncio.wait_for(aborts.get(), 10)).data)
    assert (notice.request_id, notice.reason) == (rid, "timeout")
    after = RequestRecord.model_validate_json((await kv.get(rid)).value)
    assert (after.status, after.error) == (RequestStatus.FAILED, "timeout")


async def test_malformed_admission_is_terminated_and_admission_goes_on(orchestrator, nc) -> None:
    js = nc.jetstream()
    terminations: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(
        f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{SUBJECTS.requests_stream}.{ORCHESTRATOR_ADMISSION_CONSUMER}",
        cb=terminations.put,
    )
    await barrier(nc)
    ack = await js.publish(SUBJECTS.requests, b"\x93 not an admission")
    # The broker's own word that the orchestrator terminated it (neither acknowledged nor left).
    terminated = json.loads((await asyncio.wait_for(terminations.get(), 10)).data)
    await sub.unsubscribe()
    assert terminated["stream_seq"] == ack.seq, terminated
    for _ in range(40):
        info = await js.consumer_info(SUBJECTS.requests_stream, ORCHESTRATOR_ADMISSION_CONSUMER)
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.05)
    assert info.num_ack_pending == 0 and info.delivered.stream_seq >= ack.seq
    await test_no_live_replica_is_answered_with_503(orchestrator, nc)


async def counted(
    url: str, before: Samples, name: str, want: float, timeout_s: float = 10.0, **labels
) -> None:
    """Wait until counter ``name`` (with ``labels``) has grown by ``want`` since ``before``: it is
    incremented just after the work it counts is visible, so a scrape right after may be early.
    More than ``want``, or not within ``timeout_s``, fails."""
    got = 0.0

    async def grown() -> bool:
        nonlocal got
        got = delta(before, await asyncio.to_thread(scrape, url), name, **labels)
        return got >= want

    await until(grown, f"{name}{labels} grown by {want}", timeout_s)
    assert got == want, f"{name}{labels} grew by {got}, expected {want}"


async def gauge_until(url: str, name: str, ok, timeout_s: float = 10.0, **labels) -> float:
    """Poll gauge ``name`` until ``ok(value)``; its value then (fails after ``timeout_s``)."""

    async def value_if_ok() -> tuple[float] | None:
        value = total(await asyncio.to_thread(scrape, url), name, **labels)
        return (value,) if ok(value) else None  # a tuple: 0.0 may be the value waited for

    (value,) = await until(value_if_ok, f"{name}{labels} as wanted", timeout_s)
    return value


async def test_admission_outcomes_are_exported(orchestrator, nc) -> None:
    url = orchestrator.metrics_url
    before = scrape(url)
    stage0: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(f"omni.{PIPELINE}.stage.0.>", cb=stage0.put)
    js = nc.jetstream()
    answers = []
    for adm in (admission(), admission(deadline_s=-1)):  # nobody is live; already expired
        out: asyncio.Queue = asyncio.Queue()
        await nc.subscribe(SUBJECTS.out(GATEWAY, adm.request_id), cb=out.put)
        await js.publish(SUBJECTS.requests, adm.encode())
        answers.append(decode(ClientEvent, (await asyncio.wait_for(out.get(), 10)).data))
    assert [(e.status, e.code) for e in answers] == [(503, "no_live_replica"), (504, "timeout")]
    async with live_workers(nc, {0: [0], 1: [0], 2: [0]}):
        sent = [admission() for _ in range(2)]
        for adm in sent:
            await js.publish(SUBJECTS.requests, adm.encode())
        tasks = [decode(StageTask, (await asyncio.wait_for(stage0.get(), 10)).data) for _ in sent]
    assert sorted(t.request_id for t in tasks) == sorted(a.request_id for a in sent)
    name = "vllm:omni_orchestrator_admissions_total"
    await counted(url, before, name, 1, outcome="no_live_replica")
    await counted(url, before, name, 1, outcome="expired")
    await counted(url, before, name, 2, outcome="dispatched")


async def test_queue_depth_and_loop_lag_show_a_stopped_orchestrator(orchestrator, nc) -> None:
    """Admissions pile up in the requests stream while the orchestrator is stopped (``SIGSTOP``):
    once it runs again its admission-queue-depth gauge shows them waiting (it reads the consumer
    as its first act: its period passed during the stop), then drops to 0 as they are handled;
    its event-loop lag histogram holds the time it was stopped."""
    url, pid = orchestrator.metrics_url, orchestrator.proc.pid
    depth = "vllm:omni_orchestrator_admission_queue_depth"
    model = f"{PIPELINE}-model"
    await gauge_until(url, depth, lambda v: v == 0, model_name=model)  # nothing waits to begin with
    before = scrape(url)
    answers: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out_wildcard(GATEWAY), cb=answers.put)
    js = nc.jetstream()
    sent = [admission() for _ in range(3 * MAX_CONCURRENT_ADMISSIONS)]  # nobody is live: each a 503
    try:
        await stop_confirmed(pid, "the orchestrator")
        stopped = time.monotonic()
        for adm in sent:
            await js.publish(SUBJECTS.requests, adm.encode())
        # The stream holds them (the stopped process may have been handed a batch it cannot read).
        info = await js.consumer_info(SUBJECTS.requests_stream, "orchestrator")
        waiting = info.num_pending
        assert waiting >= len(sent) - MAX_CONCURRENT_ADMISSIONS, info
        # stopped past its queue-depth period, so that gauge is read first when it runs again
        await asyncio.sleep(max(0.0, HEALTH_PERIOD_S + 0.5 - (time.monotonic() - stopped)))
    finally:
        os.kill(pid, signal.SIGCONT)
        stopped_s = time.monotonic() - stopped
    seen = await gauge_until(url, depth, lambda v: v > 0, model_name=model)
    assert seen <= waiting, (seen, waiting)
    answered: dict[str, int] = Counter()
    deadline = time.monotonic() + 30
    ids = {a.request_id for a in sent}
    while set(answered) != ids:
        assert time.monotonic() < deadline, f"{len(answered)} of {len(sent)} answered"
        ev = decode(ClientEvent, (await asyncio.wait_for(answers.get(), 10)).data)
        if ev.request_id not in ids:
            continue  # a request of an earlier test, failed now that its fake replicas are gone
        assert (ev.status, ev.code) == (503, "no_live_replica"), ev
        answered[ev.request_id] += 1
    await gauge_until(url, depth, lambda v: v == 0, model_name=model)
    # Each admission was answered, and counted once: the batch the stopped process held was
    # redelivered past its 1 s ack_wait and handled twice (answered twice: harmless, the gateway
    # takes the first answer of a request).
    await counted(
        url, before, "vllm:omni_orchestrator_admissions_total", len(sent), outcome="no_live_replica"
    )
    while not answers.empty():
        ev = decode(ClientEvent, answers.get_nowait().data)
        if ev.request_id in ids:
            assert (ev.status, ev.code) == (503, "no_live_replica"), ev
            answered[ev.request_id] += 1
    print(f"{sum(answered.values()) - len(sent)} of {len(sent)} admissions were answered twice")
    # The loop-lag sampler slept through the stop: its samples add up to at least the stop
    # (less the one period it meant to sleep).
    after = scrape(url)
    lag = delta(before, after, "vllm:omni_orchestrator_loop_lag_s_sum", model_name=model)
    assert lag >= stopped_s - LOOP_LAG_PERIOD_S, (lag, stopped_s)
    assert delta(
        before, after, "vllm:omni_orchestrator_loop_lag_s_bucket", model_name=model, le="1.0"
    ) < delta(before, after, "vllm:omni_orchestrator_loop_lag_s_count", model_name=model), (
        "no lag sample above 1 s"
    )
