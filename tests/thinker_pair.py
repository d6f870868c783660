"""Two real thinker workers and a real gateway on the session's nats-server, shared by the fault
tests of ``tests/integration`` that need a second replica to move to (test_engine_death,
test_orchestrator_death). Each module adds the orchestrators it judges; the two vLLM engines, the
slowest part of those modules to start, start once per session (``thinker_pair`` in
``tests/integration/conftest.py``). A test that kills a worker leaves it dead;
:meth:`ThinkerPair.both_serving` starts it again for a test that needs both."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.errors import Error as NatsError

from libs.common.subjects import Subjects
from libs.stack.local_nats import free_port
from tests.procs import THINKER_YAML, ServiceProcess, start_service, stop_all, write_pipeline

PIPELINE = "thinkerpair"
MODEL = f"{PIPELINE}-model"
GATEWAY = "gwthinkerpair"
STALL_TIMEOUT_S = 5.0
"""The stage's ``stall_timeout_s``, seconds. At 3 s, a box starved by the faults (the broker went
silent for ~3 s once, see docs/reliability.md, "Known limits") had a healthy replica judged
stalled too."""
NO_REPLICA_WAIT_S = 3.0
"""The stage's ``no_replica_wait_s``: how long a request bound to a dead replica waits for a live
one before it fails, seconds (every orchestrator probes the dead replica meanwhile)."""
STAGES_YAML = (
    THINKER_YAML.replace("replicas: 1", "replicas: 2").replace(
        "dtype: float32}", "dtype: float32, max_num_seqs: 1}"
    )
    + f"    stall_timeout_s: {STALL_TIMEOUT_S}\n"
    + f"    no_replica_wait_s: {NO_REPLICA_WAIT_S}\n"
)
"""Two thinker replicas that run one request at a time (the others wait in the engine): a fault
that strikes seconds late still finds requests there."""
SERVING = ": serving omni."
"""What a worker logs once it takes requests."""
SETTLED_PROBES, PROBE_EVERY_S, PROBE_WAIT_S = 6, 0.5, 1.0
"""A restarted worker is settled once it answered this many liveness probes in a row, sent this
far apart (seconds), each within this (seconds)."""


@dataclass
class ThinkerPair:
    base_url: str
    """The gateway's OpenAI base URL (``.../v1``)."""
    gateway: ServiceProcess
    path: Path
    """The pipeline file."""
    tmp: Path
    nats_url: str
    workers: dict[int, ServiceProcess] = field(default_factory=dict)
    """Thinker replica → its current worker process."""

    @property
    def gateway_metrics(self) -> str:
        """The gateway's ``/metrics`` (on its admin port)."""
        assert self.gateway.metrics_url is not None
        return self.gateway.metrics_url

    def start_worker(self, replica: int) -> ServiceProcess:
        log = self.tmp / f"worker{replica}-{time.time_ns()}.log"
        worker = start_service(
            ["worker", "--stage", "0", "--replica", str(replica)],
            self.nats_url,
            self.path,
            log,
            {"VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        worker.shared = True
        self.workers[replica] = worker
        return worker

    def start_orchestrator(self, log: Path, instance: str | None = None) -> ServiceProcess:
        """An orchestrator of the pair's pipeline (the caller waits for it and stops it)."""
        env = {"OMNIRELAY_INSTANCE_ID": instance} if instance else None
        return start_service(["orchestrator"], self.nats_url, self.path, log, env)

    async def both_serving(self) -> None:
        """Start anew a worker an earlier test's fault ended, and wait until both serve and answer
        their liveness probes promptly (:meth:`_settled`)."""
        restarted = [r for r, w in list(self.workers.items()) if w.proc.poll() is not None]
        for r in restarted:
            self.start_worker(r)
        for w in self.workers.values():
            await w.await_log(SERVING, timeout_s=300)
        if restarted:
            await self._settled(restarted)

    async def _settled(self, replicas: list[int], timeout_s: float = 60.0) -> None:
        """Wait until each of ``replicas`` has answered :data:`SETTLED_PROBES` liveness probes in a
        row, :data:`PROBE_EVERY_S` apart, each within :data:`PROBE_WAIT_S`: a worker fresh from its
        start once answered nothing for 16 s right after it logged that it serves (run2 of
        2026-11-26), and the test's orchestrators judged it stalled besides the replica the test
        killed."""
        nc = await nats.connect(self.nats_url)
        try:
            for r in replicas:
                subject, in_row = Subjects(PIPELINE).alive(0, r), 0
                deadline = time.monotonic() + timeout_s
                while in_row < SETTLED_PROBES:
                    assert time.monotonic() < deadline, f"thinker {r} did not answer its probes promptly"
                    try:
                        await nc.request(subject, b"", timeout=PROBE_WAIT_S)
                        in_row += 1
                    except NatsError:
                        in_row = 0
                    await asyncio.sleep(PROBE_EVERY_S)
        finally:
            await nc.close()

    def alive(self) -> list[int]:
        """The replicas whose worker process runs."""
        return [r for r, w in self.workers.items() if w.proc.poll() is None]


def start_pair(nats_url: str, tmp: Path) -> ThinkerPair:
    """The gateway and both workers, started side by side; returns once the gateway listens and
    both workers serve."""
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML, timeout_s=120)
    port = free_port()
    gateway = start_service(
        ["gateway", "--port", str(port)], nats_url, path, tmp / "gw.log", {"OMNIRELAY_INSTANCE_ID": GATEWAY}
    )
    gateway.shared = True
    pair = ThinkerPair(f"http://127.0.0.1:{port}/v1", gateway, path, tmp, nats_url)
    for r in (0, 1):
        pair.start_worker(r)
    gateway.wait_log("Uvicorn running")
    for w in pair.workers.values():
        w.wait_log(SERVING, timeout_s=300)
    return pair


def stop_pair(pair: ThinkerPair) -> None:
    """Stop every process of the pair, continuing any a test left stopped first."""
    everyone = [pair.gateway, *pair.workers.values()]
    for p in everyone:
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)
    stop_all(everyone)
