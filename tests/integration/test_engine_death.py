"""Faults of a real thinker worker under a streamed request, judged by a real orchestrator, with a
real gateway, the official ``openai`` client and a second real thinker worker to move to
(docs/reliability.md, "Who notices what"):

- the worker stopped (``SIGSTOP``): no answer to any probe for ``stall_timeout_s``, the request
  moves (``stall``); after ``SIGCONT`` the worker reads the orchestrator's ``moved`` notice and stops
  the request, and what it still sent is dropped by the gateway's fence and counted;
- its EngineCore killed (``SIGKILL``): the worker answers the probes with ``engine_dead``, the
  request moves (``engine_dead``) and the worker exits with status 3;
- its EngineCore stopped (``SIGSTOP``, a hung engine): the worker answers every probe, busy with a
  flat progress counter; the request moves (``stall``) and after ``HUNG_AFTER_STALLS ×
  stall_timeout_s`` the worker kills its engine and exits with status 4.

Six streams run on the two replicas (four in the tests that stop a process); in every case each client gets every token exactly once:
its tokens are compared with those each attempt put on the wire (``tests/client_streams.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from benchmarks.chat_streams import send
from benchmarks.process_table import descendants
from libs.common.bus import requests_kv
from libs.common.envelopes import ClientEventType, Liveness, decode
from libs.common.settings import WorkerSettings
from libs.common.subjects import Subjects
from libs.stack.processes import until
from services.orchestrator.liveness import PROBE_PERIOD_S, PROBE_TIMEOUT_S
from services.stage_worker.engine_health import ENGINE_DEAD_EXIT_STATUS, ENGINE_HUNG_EXIT_STATUS
from services.stage_worker.progress import HUNG_AFTER_STALLS
from tests.client_streams import (
    PROMPT,
    Seen,
    Streams,
    Wire,
    bound_by_replica,
    holding,
    judge_moves,
    records_at_end,
    struck,
)
from tests.metrics_scrape import delta, scrape
from tests.pipeline_services import Services
from tests.procs import ServiceProcess, gone, kill_confirmed, process_state, stop_all, stop_confirmed
from tests.thinker_pair import MODEL, PIPELINE, STALL_TIMEOUT_S, ThinkerPair, strike_order

pytestmark = pytest.mark.integration

PROBE_WAIT_S = STALL_TIMEOUT_S - 1.0
"""How long the test's own liveness probe waits for its answer, seconds."""
LONG = 600
"""Tokens of each stream where the fault strikes the engine: the serial replica runs its three one
at a time, which takes seconds, so a fault that strikes late still finds them there."""
UNDER_WAY_LONG = 1900
"""Tokens of each stream in the tests that stop a process (the worker, or its EngineCore), which
need a request still under way on the victim when it stops: 600 tokens can all be generated
between the victim's liveness answer and the stop (the tiny thinker's context is 2048)."""
UNDER_WAY_STREAMS = 4
"""Streams of the tests that stop a process: two on each replica (on the serial one, one running and
one waiting: it needs two on the victim); each of its tokens is generated once or twice, so fewer
keep its time down."""


def engine_core_of(worker: ServiceProcess) -> int:
    """The pid of a serving thinker worker's EngineCore process."""
    (core,) = [
        p for p in descendants(worker.proc.pid) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()
    ]
    return core


@pytest.fixture(scope="module")
def orchestrator(thinker_pair: ThinkerPair, tmp_path_factory) -> Iterator[ServiceProcess]:
    """The module's own orchestrator of the pair's pipeline, which judges the faults."""
    own = Services(thinker_pair.nats_url, thinker_pair.path, tmp_path_factory.mktemp("enginedeath"))
    with own.start(gateway=False).serving():
        yield own.orchestrator


STREAMS = 6
"""Streams under way when a fault strikes (three on each replica)."""
TRIES = 3
"""Sets of streams started until a replica holds two of one (a replica whose third admission was
redelivered after its first two had ended never does; nor does any while the broker is silent for
seconds and the streams end meanwhile: 8 s once, 2026-11-28)."""


@dataclass
class Run:
    """The streams under test, from their clients and on the wire, and the replica to strike."""

    nc: Client
    kv: KeyValue
    wire: Wire
    streams: Streams
    bound: dict[int, set[str]]
    """Thinker replica → the streams bound to it at admission."""
    victim: int
    """The replica the fault strikes: one that held two of the streams (:func:`holding`)."""

    @property
    def on_victim(self) -> set[str]:
        return self.bound[self.victim]


@contextlib.asynccontextmanager
async def streaming(pair: ThinkerPair, tokens: int = LONG, count: int = STREAMS) -> AsyncIterator[Run]:
    """Both workers serving, a warm stack, then ``count`` greedy streams of ``tokens``, admitted,
    and a replica that holds two of them (up to :data:`TRIES` sets of streams).

    The fault's victim never serves another test: its worker is stopped on the way out, pass or
    fail, unless it has exited already (its faults end it when the test passes), and the next
    test's :meth:`~tests.thinker_pair.ThinkerPair.both_serving` starts a fresh one. A victim left
    running would be an incarnation the orchestrator has judged dead (evictions are per
    incarnation, docs/reliability.md's known limits), or a worker about to exit: in CI of
    2026-11-28 one test's failure left its victim dying, the next test's moves went to it, and
    three more tests failed with ``no_live_replica``."""
    await pair.both_serving()
    client = pair.client(180)
    nc = await nats.connect(pair.nats_url)
    wire = Wire()
    await wire.listen(nc, PIPELINE)
    streams: Streams | None = None
    victim: int | None = None
    try:
        for _ in range(60):  # the orchestrator's registry view may not have a new worker yet
            warm = Seen()
            await send(client, MODEL, warm, PROMPT, 8)
            if warm.error is None:
                break
            await asyncio.sleep(0.5)
        assert warm.error is None, warm.error
        kv = await requests_kv(nc.jetstream())
        for _ in range(TRIES):
            streams = await Streams.start(client, MODEL, count, tokens, nc)
            bound = await bound_by_replica(kv, streams, PIPELINE)
            victim = await holding(nc, PIPELINE, strike_order(bound), timeout_s=30)
            if victim is not None:
                break
            streams.cancel()  # none was struck: nothing is judged of them
            streams = None
        assert streams is not None and victim is not None, f"in {TRIES} sets of streams no replica held two"
        yield Run(nc, kv, wire, streams, bound, victim)
    finally:
        if streams is not None:
            streams.cancel()
        await nc.close()
        await client.close()
        if victim is not None:
            worker = pair.workers[victim]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.proc.pid, signal.SIGCONT)  # a stopped one must run to stop
            await asyncio.to_thread(stop_all, [worker])


async def _stop_replica(worker: ServiceProcess, what: str) -> list[int]:
    """``SIGSTOP`` a worker's whole process group — the worker and its engine processes, as
    ``docker pause`` stops a container — and wait until each is stopped (state ``T``); their pids.
    (The worker alone stopped, its engine would finish the requests meanwhile, and nothing would
    be left to stop after ``SIGCONT``.)"""
    pids = [worker.proc.pid, *descendants(worker.proc.pid)]
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    await until(
        lambda: all(process_state(p) == "T" for p in pids), f"{what}: every process stopped", 5, every_s=0.02
    )
    return pids


async def test_a_killed_engine_core_moves_the_requests_and_its_worker_exits(
    thinker_pair: ThinkerPair, orchestrator: ServiceProcess
) -> None:
    # Nothing slow between the victim's word that it holds two streams and the kill: the fast
    # replica ends a stream a second (a scrape on a loaded box has taken longer).
    before = scrape(orchestrator.metrics_url)
    async with streaming(thinker_pair) as run:
        victim = run.victim
        worker = thinker_pair.workers[victim]
        core = engine_core_of(worker)
        # The engine is one process: its EngineCore runs the model (engine_executor.py), bound
        # to one core as vLLM's own executor would bind its model runner.
        assert descendants(core) == [], "the engine runs its model in a process of its own"
        assert len(os.sched_getaffinity(core)) == 1, os.sched_getaffinity(core)
        # The engine yields to the control plane: every thread of its processes at the default
        # nice value, the worker's own (its event loop) untouched.
        engine = [core, *descendants(core)]
        nices = {
            t: os.getpriority(os.PRIO_PROCESS, int(t)) for p in engine for t in os.listdir(f"/proc/{p}/task")
        }
        assert set(nices.values()) == {WorkerSettings().engine_nice} and WorkerSettings().engine_nice > 0, (
            nices
        )
        assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == 0
        await kill_confirmed(core, f"the EngineCore of thinker {victim}")
        killed = time.monotonic()
        bound = await struck(run.kv, run.on_victim, 30)
        moved_after_s = time.monotonic() - killed
        code = await asyncio.to_thread(worker.proc.wait, 20)
        await run.streams.finish()
        records = await records_at_end(run.kv, run.streams)
        after = scrape(orchestrator.metrics_url)
    judge_moves(
        run.streams, run.wire, records, bound, [(1, victim, None), (2, 1 - victim, "engine_dead")], LONG
    )
    assert code == ENGINE_DEAD_EXIT_STATUS
    evicted = delta(
        before,
        after,
        "vllm:omni_replica_evictions_total",
        stage="0",
        replica=str(victim),
        reason="engine_dead",
    )
    assert evicted == 1
    labels = {
        "stage": "0",
        "from_replica": str(victim),
        "to_replica": str(1 - victim),
        "reason": "engine_dead",
    }
    assert delta(before, after, "vllm:omni_requests_migrated_total", **labels) == len(bound)
    print(
        f"{len(bound)} stream(s) moved {moved_after_s:.2f} s after the EngineCore's kill; worker exit {code}"
    )


async def _holds_none(nc: Client, replica: int) -> bool:
    """Whether thinker ``replica`` says, in its liveness answer, that it holds no request."""
    reply = await nc.request(Subjects(PIPELINE).alive(0, replica), b"", timeout=PROBE_WAIT_S)
    return decode(Liveness, reply.data).in_flight == 0


async def _probe_until(run: Run, replica: int, done: asyncio.Task[set[str]]) -> list[tuple[float, Liveness]]:
    """Ask thinker ``replica``'s liveness subject every 0.25 s, as the orchestrators do, until
    ``done`` is; its answers with when they came (``time.monotonic()``; a probe left unanswered
    for :data:`PROBE_WAIT_S` fails the test: the broker alone has gone quiet for seconds on a
    loaded box, docs/reliability.md)."""
    answers = []
    subject = Subjects(PIPELINE).alive(0, replica)
    while not done.done():
        reply = await run.nc.request(subject, b"", timeout=PROBE_WAIT_S)
        answers.append((time.monotonic(), decode(Liveness, reply.data)))
        await asyncio.sleep(0.25)
    return answers


async def test_a_hung_engine_core_moves_the_requests_and_its_worker_gives_up_on_it(
    thinker_pair: ThinkerPair, orchestrator: ServiceProcess
) -> None:
    async with streaming(thinker_pair, UNDER_WAY_LONG, UNDER_WAY_STREAMS) as run:
        victim = run.victim
        worker = thinker_pair.workers[victim]
        core = engine_core_of(worker)
        try:
            await stop_confirmed(core, f"the EngineCore of thinker {victim}")
            stopped = time.monotonic()
            hit = asyncio.create_task(struck(run.kv, run.on_victim, STALL_TIMEOUT_S + 30))
            answers = await _probe_until(run, victim, hit)
            bound = await hit
            moved_after_s = time.monotonic() - stopped
            assert process_state(core) == "T", "the EngineCore ran again: not a hang"
            code = await asyncio.to_thread(worker.proc.wait, HUNG_AFTER_STALLS * STALL_TIMEOUT_S + 20)
            exited_after_s = time.monotonic() - stopped
            await run.streams.finish()
            records = await records_at_end(run.kv, run.streams)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
    judge_moves(
        run.streams, run.wire, records, bound, [(1, victim, None), (2, 1 - victim, "stall")], UNDER_WAY_LONG
    )
    # A verdict of the engine's progress, not of silence: the worker answered every probe, never
    # a stall timeout apart (a verdict of silence needs that much), and until a verdict was
    # possible (a stall timeout after the stop; then its requests move and it stops them) it
    # was busy with its progress flat from a second after the stop (outputs on their way may
    # still be counted).
    times = [t for t, _ in answers]
    assert max(b - a for a, b in itertools.pairwise(times)) < STALL_TIMEOUT_S, times
    before_verdict = [(t, a) for t, a in answers if t < stopped + STALL_TIMEOUT_S - 0.5]
    assert before_verdict and all(a.busy >= 1 and not a.engine_dead for _, a in before_verdict), answers
    assert len({a.progress for t, a in before_verdict if t >= stopped + 1.0}) == 1, [
        (t - stopped, a.progress) for t, a in answers
    ]
    assert moved_after_s >= STALL_TIMEOUT_S - 0.5, f"moved {moved_after_s:.1f} s after the hang"
    assert code == ENGINE_HUNG_EXIT_STATUS
    assert exited_after_s >= HUNG_AFTER_STALLS * STALL_TIMEOUT_S - 0.5, exited_after_s
    for _ in range(20):
        if gone(core):
            break
        await asyncio.sleep(0.1)
    assert gone(core), "the hung EngineCore outlived its worker"
    print(
        f"{len(bound)} stream(s) moved {moved_after_s:.1f} s after the EngineCore's SIGSTOP "
        f"({len(answers)} answers, progress flat at {answers[-1][1].progress}); "
        f"worker exit {code} after {exited_after_s:.1f} s"
    )


async def test_a_stopped_replica_loses_its_requests_and_stops_them_after_sigcont(
    thinker_pair: ThinkerPair, orchestrator: ServiceProcess
) -> None:
    """Its victim runs on after SIGCONT as the incarnation judged dead, until :func:`streaming`
    stops it."""
    async with streaming(thinker_pair, UNDER_WAY_LONG, UNDER_WAY_STREAMS) as run:
        before = scrape(thinker_pair.gateway_metrics)
        # After SIGCONT the victim must stop those it had taken (the point of the test), and
        # one of UNDER_WAY_LONG tokens is left for the stop to strike.
        victim = run.victim
        worker = thinker_pair.workers[victim]
        try:
            stopped_pids = await _stop_replica(worker, f"thinker {victim}")
            stopped = time.monotonic()
            bound = await struck(run.kv, run.on_victim, STALL_TIMEOUT_S + 30)
            moved_after_s = time.monotonic() - stopped
        finally:
            resumed = time.monotonic()
            os.killpg(worker.proc.pid, signal.SIGCONT)
        await run.streams.finish()
        records = await records_at_end(run.kv, run.streams)
        # Those under way on the victim when it stopped are stopped there after SIGCONT (those
        # still queued on it were taken from its input and never started).
        under_way = {rid for rid in bound if records[rid].stages[0].attempts[1].phase == "in_progress"}
        assert under_way, [records[rid].stages[0].attempts[1].phase for rid in bound]
        # Until the victim holds none of them: each was stopped there, or (a failure below)
        # finished there.
        await until(lambda: _holds_none(run.nc, victim), "the resumed replica let its moved requests go", 30)
        after = scrape(thinker_pair.gateway_metrics)
    judge_moves(
        run.streams, run.wire, records, bound, [(1, victim, None), (2, 1 - victim, "stall")], UNDER_WAY_LONG
    )
    # Attempt 1 of the moved requests did not end: the worker stopped them, and their inputs
    # were not acknowledged (they were the new attempts').
    for rid in bound:
        ends = (ClientEventType.TEXT_DONE, ClientEventType.ERROR)
        assert not [e for _, e in run.wire.events[rid] if e.attempt == 1 and e.type in ends]
    # What the resumed worker sent before it read the notices reached the gateway after its fence
    # rose (the moves were carried out before SIGCONT): each such event is dropped and counted,
    # as stale while the gateway still holds its request, as of an ended request once the moved
    # request has completed (a slow SIGCONT on a loaded box).
    late = [e for rid in bound for at, e in run.wire.events[rid] if e.attempt == 1 and at >= resumed]
    stale = delta(before, after, "vllm:omni_stale_events_dropped_total", stage="0")
    of_ended = delta(before, after, "vllm:omni_bus_messages_rejected_total", reason="ended_request")
    assert stale + of_ended == len(late), (
        stale,
        of_ended,
        [(e.request_id, e.type.value, e.seq) for e in late],
    )
    # A verdict of silence: the orchestrator counts it from the victim's last answer, which may
    # precede the stop by a probe period and, when that probe's answer came too late, its timeout.
    earliest = STALL_TIMEOUT_S - PROBE_PERIOD_S - PROBE_TIMEOUT_S
    assert moved_after_s >= earliest, f"moved {moved_after_s:.1f} s after SIGSTOP"
    print(
        f"{len(bound)} stream(s) moved {moved_after_s:.1f} s after SIGSTOP of {len(stopped_pids)} processes; "
        f"{len(late)} late event(s) dropped"
    )
