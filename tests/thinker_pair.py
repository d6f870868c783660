"""Two real thinker workers and a real gateway on the session's nats-server, shared by the fault
tests of ``tests/integration`` that need a second replica to move to (test_engine_death,
test_orchestrator_death). Each module adds the orchestrators it judges; the two vLLM engines, the
slowest part of those modules to start, start once per session (``thinker_pair`` in
``tests/integration/conftest.py``). A test that kills a worker leaves it dead;
:meth:`ThinkerPair.both_serving` starts it again for a test that needs both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nats
from nats.errors import Error as NatsError
from openai import AsyncOpenAI

from libs.common.subjects import Subjects
from libs.stack.processes import until
from tests.pipeline_services import Services
from tests.procs import THINKER_YAML, ServiceProcess, start_service, write_pipeline

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
"""Two thinker replicas, each running one request at a time as this file says (the others wait in
the engine): a fault that strikes seconds late still finds requests there. Replica
:data:`BATCHING` reads :data:`BATCHING_YAML` instead."""
SERIAL, BATCHING = 0, 1
"""The replica that runs one request at a time, the one a fault strikes when both hold as many
streams (:func:`strike_order`), and the one that runs :data:`BATCH` at once: the streams moved to
it do not queue behind its own, which takes the fault tests' final phase from the sum of every
stream's time down to about the longest one's."""
BATCH = 8
BATCHING_YAML = STAGES_YAML.replace("max_num_seqs: 1", f"max_num_seqs: {BATCH}")
SETTLED_PROBES, PROBE_EVERY_S, PROBE_WAIT_S = 6, 0.5, 1.0
"""A restarted worker is settled once it answered this many liveness probes in a row, sent this
far apart (seconds), each within this (seconds)."""
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""Each worker's vLLM KV cache on the CPU, GiB."""


@dataclass
class ThinkerPair:
    """The pair's services, kept for the session (no orchestrator: each module adds those it
    judges, with :meth:`start_orchestrator` or services of its own on :attr:`path`)."""

    services: Services
    batching_pipeline: Path
    """The pipeline file replica :data:`BATCHING` reads (:data:`BATCHING_YAML`)."""

    @property
    def base_url(self) -> str:
        """The gateway's OpenAI base URL (``.../v1``)."""
        return f"{self.services.base_url}/v1"

    @property
    def gateway(self) -> ServiceProcess:
        """The gateway's process."""
        assert self.services.gateway is not None
        return self.services.gateway

    @property
    def gateway_metrics(self) -> str:
        """The gateway's ``/metrics`` (on its admin port)."""
        return self.services.metrics_url

    @property
    def nats_url(self) -> str:
        """The session's nats-server."""
        return self.services.nats_url

    @property
    def path(self) -> Path:
        """The pipeline file."""
        return self.services.pipeline

    @property
    def workers(self) -> dict[int, ServiceProcess]:
        """Thinker replica → its current worker process."""
        return {r: w for (_, r), w in self.services.workers.items()}

    def client(self, timeout_s: float) -> AsyncOpenAI:
        """The official client of the pair's gateway (``timeout_s`` seconds per request)."""
        return self.services.client(timeout_s)

    def start_orchestrator(self, log: Path, instance: str | None = None) -> ServiceProcess:
        """An orchestrator of the pair's pipeline (the caller waits for it and stops it)."""
        env = {"OMNIRELAY_INSTANCE_ID": instance} if instance else None
        return start_service(["orchestrator"], self.nats_url, self.path, log, env)

    async def both_serving(self) -> None:
        """Start anew a worker an earlier test's fault ended, and wait until both serve (their
        registrations, the registry views and ``/health``: :meth:`Services.ready`) and answer
        their liveness probes promptly (:meth:`_settled`)."""
        restarted = [r for r, w in self.workers.items() if w.proc.poll() is not None]
        for r in restarted:
            self.services.start_worker(0, r, self.worker_env(r))
        await self.services.ready()
        if restarted:
            await self._settled(restarted)

    async def _settled(self, replicas: list[int], timeout_s: float = 60.0) -> None:
        """Wait until each of ``replicas`` has answered :data:`SETTLED_PROBES` liveness probes in a
        row, :data:`PROBE_EVERY_S` apart, each within :data:`PROBE_WAIT_S`: a worker fresh from its
        start once answered nothing for 16 s right after it logged that it serves (run2 of
        2026-11-26), and the test's orchestrators judged it stalled besides the replica the test
        killed."""
        nc = await nats.connect(self.nats_url)

        async def settled(r: int) -> None:
            subject, in_row = Subjects(PIPELINE).alive(0, r), 0

            async def answered_in_row() -> bool:
                nonlocal in_row
                try:
                    await nc.request(subject, b"", timeout=PROBE_WAIT_S)
                    in_row += 1
                except NatsError:
                    in_row = 0
                return in_row >= SETTLED_PROBES

            what = f"thinker {r} answering {SETTLED_PROBES} probes in a row promptly"
            await until(answered_in_row, what, timeout_s, every_s=PROBE_EVERY_S)

        try:
            for r in replicas:
                await settled(r)
        finally:
            await nc.close()

    def worker_env(self, replica: int) -> dict[str, str]:
        """What a worker of ``replica`` adds to its environment."""
        if replica == BATCHING:
            return {**WORKER_ENV, "OMNIRELAY_PIPELINE": str(self.batching_pipeline)}
        return WORKER_ENV

    def alive(self) -> list[int]:
        """The replicas whose worker process runs."""
        return [r for r, w in self.workers.items() if w.proc.poll() is None]


def start_pair(nats_url: str, tmp: Path) -> ThinkerPair:
    """The gateway and both workers, started side by side; returns once they serve."""
    path = write_pipeline(tmp / "p.yaml", PIPELINE, STAGES_YAML, timeout_s=120)
    pair = ThinkerPair(
        Services(nats_url, path, tmp, shared=True),
        write_pipeline(tmp / "batching.yaml", PIPELINE, BATCHING_YAML, timeout_s=120),
    )
    pair.services.start(orchestrators=0, gateway_env={"OMNIRELAY_INSTANCE_ID": GATEWAY})
    for r in (SERIAL, BATCHING):
        pair.services.start_worker(0, r, pair.worker_env(r))
    pair.services.wait_ready()
    return pair


def strike_order(bound: dict[int, set[str]]) -> list[int]:
    """The replicas a fault may strike, given the streams bound to each: :data:`SERIAL` alone
    when it holds two (one runs, one waits), else every replica, those with more streams first."""
    if len(bound.get(SERIAL, ())) >= 2:
        return [SERIAL]
    return sorted(bound, key=lambda r: (-len(bound[r]), r))


def stop_pair(pair: ThinkerPair) -> None:
    """Stop every process of the pair, continuing any a test left stopped first."""
    pair.services.stop()
