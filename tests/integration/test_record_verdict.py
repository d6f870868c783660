"""A worker judges a request's start by its record while the engine already runs it
(services/stage_worker/record_check.py, ``Worker._check_record``; docs/reliability.md, "A request at a worker").

A real nats-server and a real thinker worker (the mock engine: the real handler, publishing path
no model compute, paced so that a request lasts a while). The test plays the
orchestrator: it writes each request's record the way the orchestrator's own move functions make
it (``plan_move``/``apply_move``) and publishes stage 0's input. What it judges is what left the
worker: client events on the request's ``out`` subject, chunks on each talker replica's input
subject, and whether the input was acknowledged.

- A control request whose record agrees streams to its client: the worker serves, and fast.
- An input of an attempt the record says the stage moved past is stopped: nothing of it reaches
  the client, and its input is acknowledged.
- A request whose next stage moved while its input waited in the stream sends every chunk to
  that stage's current replica and attempt, none to the old one.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.bus import requests_kv
from libs.common.envelopes import ClientEvent, ClientEventType, Sampling, StageTask, TaskKind
from libs.common.publish import Hop, publish_task
from libs.common.records import RequestRecord
from libs.common.subjects import Subjects, consumer_name
from libs.stack.bus_state import barrier
from libs.stack.processes import until
from services.orchestrator.migration import apply_move, plan_move
from tests.bus import collect
from tests.pipeline_services import Services
from tests.procs import TALKER_YAML, THINKER_YAML, write_pipeline
from tests.records import bound_record

pytestmark = pytest.mark.integration

PIPELINE = "recverdict"
GATEWAY = "gwrecverdict"
SUBJECTS = Subjects(PIPELINE)
INTER_TOKEN_MS = 5
TOKENS = 40
"""Each request streams 40 tokens at 5 ms apiece: 0.2 s, so a stale one would have sent many."""
STAGES_YAML = THINKER_YAML.replace(
    "dtype: float32}", f"dtype: float32, mock: {{inter_token_ms: {INTER_TOKEN_MS}}}}}"
) + TALKER_YAML.replace("    consumes: text\n", "    replicas: 2\n    consumes: text\n")


@pytest.fixture(scope="module")
def worker(nats_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recverdict")
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML, timeout_s=60)
    with (
        Services(nats_server.url, path, tmp)
        .start(orchestrators=0, gateway=False, workers=[(0, 0)])
        .serving() as s
    ):
        yield s.worker(0)


def _record(rid: str, route: list[int]) -> RequestRecord:
    return bound_record(rid, route, pipeline=PIPELINE, gateway_id=GATEWAY)


def _moved(rec: RequestRecord, stage: int, to: int) -> None:
    """``rec`` after the orchestrator moved ``stage`` to replica ``to`` (its input not sent yet)."""
    apply_move(
        rec,
        plan_move(rec, stage, dead_replica=rec.route[stage], to_replica=to, reason="exit", limit=3),
        time.time_ns(),
    )


def _start(rid: str, route: list[int]) -> StageTask:
    """Stage 0's input, attempt 1, as the orchestrator admits it."""
    now = time.time_ns()
    return StageTask(
        request_id=rid,
        gateway_id=GATEWAY,
        arrival_ns=now,
        deadline_ns=now + 60 * 10**9,
        route=route,
        kind=TaskKind.START,
        seq=0,
        final=True,
        prompt_token_ids=[1, 2, 3, 4],
        sampling=Sampling(max_tokens=TOKENS, ignore_eos=True),
    )


async def _send(nc, rec: RequestRecord) -> asyncio.Queue[ClientEvent]:
    """Store ``rec``, listen to its request's client events, and publish its stage 0 input."""
    await (await requests_kv(nc.jetstream())).put(rec.request_id, rec.model_dump_json().encode())
    events: asyncio.Queue[ClientEvent] = asyncio.Queue()
    await nc.subscribe(SUBJECTS.out(GATEWAY, rec.request_id), cb=collect(events, ClientEvent))
    await barrier(nc)
    start = _start(rec.request_id, [0] * len(rec.route))  # attempt 1's route: replica 0 everywhere
    await publish_task(nc.jetstream(), SUBJECTS, start, Hop("o", "o", 0, 0))
    return events


async def _all_of(events: asyncio.Queue[ClientEvent], timeout_s: float = 20.0) -> list[ClientEvent]:
    """The request's client events up to its ``text_done``."""
    got: list[ClientEvent] = []
    async with asyncio.timeout(timeout_s):
        while not got or got[-1].type != ClientEventType.TEXT_DONE:
            got.append(await events.get())
    return got


async def _consumer_idle(nc) -> bool:
    info = await nc.jetstream().consumer_info(SUBJECTS.stages_stream, consumer_name(0, 0))
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_an_input_of_an_attempt_the_stage_moved_past_sends_nothing_and_is_acknowledged(
    worker, nc
) -> None:
    control = _record(f"rv-ok-{time.time_ns()}", [0])
    t0 = time.monotonic()
    got = await _all_of(await _send(nc, control))
    took = time.monotonic() - t0
    assert sum(len(e.token_ids) for e in got if e.type == ClientEventType.TEXT) == TOKENS

    stale = _record(f"rv-stale-{time.time_ns()}", [0])
    _moved(stale, 0, to=0)  # the stage moved on to attempt 2 (a replacement of this replica)
    assert stale.stages[0].attempt == 2
    events = await _send(nc, stale)
    await until(lambda: _consumer_idle(nc), "the stale input acknowledged", timeout_s=10)
    # The control streamed everything in ``took``; the stale request is given as long again.
    await asyncio.sleep(max(took, 0.5))
    assert events.empty(), f"{events.qsize()} client events of a refused start"


async def test_chunks_go_to_the_next_stages_current_attempt_when_it_moved_in_the_stream(worker, nc) -> None:
    rec = _record(f"rv-down-{time.time_ns()}", [0, 0])
    _moved(rec, 1, to=1)  # the talker moved to replica 1 (attempt 2) while the input waited
    chunks: dict[int, asyncio.Queue[StageTask]] = {r: asyncio.Queue() for r in (0, 1)}
    for r in (0, 1):
        await nc.subscribe(SUBJECTS.stage_in(1, r), cb=collect(chunks[r], StageTask))
    got = await _all_of(await _send(nc, rec))
    assert sum(len(e.token_ids) for e in got if e.type == ClientEventType.TEXT) == TOKENS

    sent: list[StageTask] = []
    async with asyncio.timeout(10):
        while not sent or not sent[-1].final:
            sent.append(await chunks[1].get())
    assert chunks[0].empty(), f"{chunks[0].qsize()} chunks went to the talker replica the move left"
    assert [c.seq for c in sent] == list(range(len(sent)))
    assert {(c.attempt, c.start_seq) for c in sent} == {(2, 0)}
    assert sum(len(c.token_ids) for c in sent) == TOKENS
