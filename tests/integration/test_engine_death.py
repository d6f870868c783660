"""A real thinker worker whose vLLM EngineCore process dies (SIGKILL) or hangs (SIGSTOP) under it.

Killed: the worker lives on just long enough to answer its liveness probe with ``engine_dead``
(the orchestrators move its requests at once), then exits with status 3 so that the launcher or
compose starts it anew. Stopped: the worker's event loop runs on and answers every probe, but its
answers show work under way and a progress counter that no longer moves (the orchestrators judge
that a stall); after ``HUNG_AFTER_STALLS × stall_timeout_s`` the worker gives up on its engine and
exits with status 4."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import nats
import pytest

from benchmarks.harness import descendants
from libs.common.envelopes import Liveness, Sampling, StageTask, TaskKind, decode
from libs.common.publish import Hop, publish_task
from libs.common.settings import WorkerSettings
from libs.common.subjects import Subjects
from services.stage_worker.engine_health import ENGINE_DEAD_EXIT_STATUS, ENGINE_HUNG_EXIT_STATUS
from services.stage_worker.progress import HUNG_AFTER_STALLS
from tests.procs import THINKER_YAML, ServiceProcess, gone, start_service, write_pipeline

pytestmark = pytest.mark.integration


async def engine_core_of(worker: ServiceProcess) -> int:
    """The pid of a thinker worker's EngineCore process, once the worker serves."""
    await worker.await_log("serving omni.", timeout_s=240)
    (core,) = [
        p for p in descendants(worker.proc.pid) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()
    ]
    return core


PIPELINE = "enginedeath"


async def test_a_worker_whose_engine_core_is_killed_says_so_and_exits(nats_server, tmp_path) -> None:
    path = write_pipeline(tmp_path / "p.yaml", PIPELINE, THINKER_YAML)
    worker = start_service(["worker"], nats_server.url, path, tmp_path / "worker.log")
    try:
        core = await engine_core_of(worker)
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
        nc = await nats.connect(nats_server.url)
        try:
            alive = Subjects(PIPELINE).alive(0, 0)
            healthy = decode(Liveness, (await nc.request(alive, b"", timeout=5)).data)
            assert not healthy.engine_dead and healthy.busy == 0
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            for _ in range(50):
                if gone(core):
                    break
                await asyncio.sleep(0.1)
            assert gone(core), f"EngineCore {core} still runs after SIGKILL"
            answer = healthy
            while time.monotonic() - killed < 5 and not answer.engine_dead:
                answer = decode(Liveness, (await nc.request(alive, b"", timeout=5)).data)
                await asyncio.sleep(0.1)
            assert answer.engine_dead, "the worker never said its engine died"
            said = time.monotonic() - killed
        finally:
            await nc.close()
        code = await asyncio.to_thread(worker.proc.wait, 10)
        assert code == ENGINE_DEAD_EXIT_STATUS
        print(f"engine_dead answered {said:.2f} s after the kill; exit {code}")
    finally:
        worker.stop()


STALL_TIMEOUT_S = 2.0


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_a_worker_whose_engine_core_hangs_shows_flat_progress_then_exits(nats_server, tmp_path) -> None:
    yaml = THINKER_YAML + f"    stall_timeout_s: {STALL_TIMEOUT_S}\n"
    path = write_pipeline(tmp_path / "p.yaml", PIPELINE, yaml)
    worker = start_service(["worker"], nats_server.url, path, tmp_path / "worker.log")
    subjects = Subjects(PIPELINE)
    try:
        core = await engine_core_of(worker)
        nc = await nats.connect(nats_server.url)
        try:
            now = time.time_ns()
            task = StageTask(
                request_id=f"hang-{now}",
                gateway_id="nobody",
                arrival_ns=now,
                deadline_ns=now + 120 * 10**9,
                route=[0],
                kind=TaskKind.START,
                seq=0,
                final=True,
                prompt_token_ids=[1, 2, 3, 4],
                sampling=Sampling(max_tokens=1500, temperature=0, ignore_eos=True),
            )
            await publish_task(nc.jetstream(), subjects, task, Hop("orchestrator", "0", 0, 0))

            async def probe() -> Liveness:
                return decode(Liveness, (await nc.request(subjects.alive(0, 0), b"", timeout=5)).data)

            first = await probe()
            while first.progress < 5:  # generating
                await asyncio.sleep(0.05)
                first = await probe()
            assert first.busy == 1 and first.in_flight == 1
            os.kill(core, signal.SIGSTOP)
            stopped = time.monotonic()
            await asyncio.sleep(0.3)
            assert _state(core) == "T", f"EngineCore {core} is not stopped"
            flat = await probe()
            answers = []
            while time.monotonic() - stopped < STALL_TIMEOUT_S + 0.5:
                answers.append(await probe())
                await asyncio.sleep(0.25)
            assert all(a.busy == 1 and a.progress == flat.progress for a in answers), "progress moved"
            code = await asyncio.to_thread(worker.proc.wait, HUNG_AFTER_STALLS * STALL_TIMEOUT_S + 10)
            took = time.monotonic() - stopped
        finally:
            await nc.close()
        assert code == ENGINE_HUNG_EXIT_STATUS
        for _ in range(20):
            if gone(core):
                break
            await asyncio.sleep(0.1)
        assert gone(core), "the hung EngineCore outlived its worker"
        assert HUNG_AFTER_STALLS * STALL_TIMEOUT_S <= took < HUNG_AFTER_STALLS * STALL_TIMEOUT_S + 4
        assert "the engine produced nothing for" in worker.text()
        print(
            f"{len(answers)} answers with flat progress {flat.progress}; exit {code} {took:.1f} s after SIGSTOP"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
        worker.stop()
