"""A real thinker worker whose vLLM EngineCore process is killed (SIGKILL): the worker lives on
just long enough to answer its liveness probe with ``engine_dead`` (the orchestrators move its
requests at once), then exits with status 3 so that the launcher or compose starts it anew."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import nats
import pytest

from benchmarks.harness import descendants
from libs.common.envelopes import ENGINE_DEAD
from libs.common.subjects import Subjects
from services.stage_worker.worker import ENGINE_DEAD_EXIT_STATUS
from tests.procs import THINKER_YAML, gone, start_service, write_pipeline

pytestmark = pytest.mark.integration

PIPELINE = "enginedeath"


async def test_a_worker_whose_engine_core_is_killed_says_so_and_exits(nats_server, tmp_path) -> None:
    path = write_pipeline(tmp_path / "p.yaml", PIPELINE, THINKER_YAML)
    worker = start_service(["worker"], nats_server.url, path, tmp_path / "worker.log")
    try:
        await worker.await_log("serving omni.", timeout_s=240)
        (core,) = [
            p for p in descendants(worker.proc.pid) if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()
        ]
        nc = await nats.connect(nats_server.url)
        try:
            alive = Subjects(PIPELINE).alive(0, 0)
            assert (await nc.request(alive, b"", timeout=5)).data == b"", "a healthy worker answers empty"
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            for _ in range(50):
                if gone(core):
                    break
                await asyncio.sleep(0.1)
            assert gone(core), f"EngineCore {core} still runs after SIGKILL"
            answer = b""
            while time.monotonic() - killed < 5 and answer != ENGINE_DEAD.encode():
                answer = (await nc.request(alive, b"", timeout=5)).data
                await asyncio.sleep(0.1)
            assert answer == ENGINE_DEAD.encode(), "the worker never said its engine died"
            said = time.monotonic() - killed
        finally:
            await nc.close()
        code = await asyncio.to_thread(worker.proc.wait, 10)
        assert code == ENGINE_DEAD_EXIT_STATUS
        print(f"engine_dead answered {said:.2f} s after the kill; exit {code}")
    finally:
        worker.stop()
