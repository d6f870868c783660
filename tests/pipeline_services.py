"""The services of one pipeline, each a real process, for a test module: its orchestrators, its
gateway and the workers it chooses, on a NATS URL the module gives (the session's nats-server, one
of its own, a cluster, a proxy in front of one). The one way the tests start a pipeline's services
by hand (``omnirelay up`` is the launcher's way: ``tests/e2e/conftest.py``).

Readiness is judged by what the services do, not by what they log:

- every orchestrator, worker and gateway started has registered in ``omni_services`` (its record
  names its own metrics or admin port, and it started after the process: a record a killed
  incarnation left behind does not count);
- every registry view (each orchestrator's, each gateway's: ``tests/bus.registry_watchers_have``)
  has been sent each worker's record, so a request may be routed to it;
- the gateway's ``/health`` answers and counts at least the orchestrators and, per stage, the
  replicas started here as live.

A module fixture is a few lines::

    with Services(nats_server.url, path, tmp).start(workers=[(0, 0)]).serving() as stack:
        yield stack
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from libs.common.bus import bucket_keys, connect, services_kv
from libs.common.pipeline import load_pipeline
from libs.common.registry import ServiceKind, ServiceRecord
from libs.common.subjects import SERVICES_BUCKET
from libs.stack.local_nats import free_port
from libs.stack.processes import until
from tests.bus import registry_watchers_have
from tests.procs import ServiceProcess, start_service, stop_left

READY_TIMEOUT_S = 300.0
"""How long every service started may take to serve, seconds: a vLLM engine on the tiny models
starts in seconds, but on the loaded two-core box several start side by side."""
POLL_S = 0.25
"""How often readiness is asked again, seconds."""
CLIENT_TIMEOUT_S = 120.0
"""The official client's own timeout per request, seconds, unless a test says otherwise."""
CLEAN_EXITS = {ServiceKind.GATEWAY: (0, -signal.SIGTERM), ServiceKind.ORCHESTRATOR: (0,)}
"""The exit statuses a gateway and an orchestrator may end with when stopped by ``SIGTERM``
(uvicorn re-raises the signal after its clean shutdown; the orchestrator exits 0). A worker's is
not judged: a fault test may have left its engine dead."""


def openai_client(base_url: str, timeout_s: float = CLIENT_TIMEOUT_S, **headers: str) -> openai.AsyncOpenAI:
    """The official async client of the gateway at ``base_url`` (its root, without ``/v1``): no
    retries of its own (a test judges every answer, a 429 or 503 among them), ``timeout_s``
    seconds per request, ``headers`` sent with every request."""
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=timeout_s,
        default_headers=headers or None,
    )


class Services:
    """The processes of one pipeline's services, started on ``nats_url`` with their logs under
    ``logs``, by role: :attr:`orchestrators`, :attr:`gateway`, :attr:`workers`. ``env`` goes to
    every one of them; ``shared`` marks them as a session fixture's (they outlive the module)."""

    def __init__(
        self,
        nats_url: str,
        pipeline: Path,
        logs: Path,
        env: dict[str, str] | None = None,
        shared: bool = False,
    ) -> None:
        self.nats_url, self.pipeline, self.logs = nats_url, pipeline, logs
        self.config = load_pipeline(pipeline)
        self.env = dict(env or {})
        self.shared = shared
        self.orchestrators: list[ServiceProcess] = []
        self.gateway: ServiceProcess | None = None
        self.workers: dict[tuple[int, int], ServiceProcess] = {}
        """(stage, replica) → its worker (the latest one started)."""
        self.processes: list[ServiceProcess] = []
        """Every process started, earlier incarnations included, in order."""
        self._port = 0
        """The gateway's HTTP port."""

    # --- handles ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The pipeline's name (its streams' and subjects' prefix)."""
        return self.config.name

    @property
    def model(self) -> str:
        """The model name the gateway serves the pipeline as."""
        return self.config.served_model_name

    @property
    def base_url(self) -> str:
        """The gateway's root URL (``/health``; the OpenAI API is below ``/v1``)."""
        assert self.gateway is not None, "no gateway started"
        return f"http://127.0.0.1:{self._port}"

    @property
    def metrics_url(self) -> str:
        """The gateway's ``/metrics`` (on its admin port)."""
        assert self.gateway is not None and self.gateway.metrics_url is not None, "no gateway started"
        return self.gateway.metrics_url

    @property
    def admin_url(self) -> str:
        """The gateway's admin listener (``/metrics``, ``/prometheus/targets``)."""
        assert self.gateway is not None, "no gateway started"
        return self.gateway.admin_url

    @property
    def orchestrator(self) -> ServiceProcess:
        """The first orchestrator."""
        return self.orchestrators[0]

    def worker(self, stage: int, replica: int = 0) -> ServiceProcess:
        """The latest worker of (``stage``, ``replica``)."""
        return self.workers[(stage, replica)]

    def client(self, timeout_s: float = CLIENT_TIMEOUT_S, **headers: str) -> openai.AsyncOpenAI:
        """The official async client of the gateway (:func:`openai_client`)."""
        return openai_client(self.base_url, timeout_s, **headers)

    # --- starting -----------------------------------------------------------------------------
    def _start(
        self, args: list[str], log: str, env: dict[str, str] | None, nats_url: str | None
    ) -> ServiceProcess:
        """``python -m cli <args>``, logging to ``log`` under :attr:`logs`, with :attr:`env` and
        ``env`` on ``nats_url`` (by default the services')."""
        proc = start_service(
            args, nats_url or self.nats_url, self.pipeline, self.logs / log, {**self.env, **(env or {})}
        )
        proc.shared = self.shared
        self.processes.append(proc)
        return proc

    def start_orchestrator(self, env: dict[str, str] | None = None) -> ServiceProcess:
        """One more orchestrator (``env`` added to its environment)."""
        proc = self._start(["orchestrator"], f"orchestrator{len(self.orchestrators)}.log", env, None)
        self.orchestrators.append(proc)
        return proc

    def start_gateway(self, env: dict[str, str] | None = None) -> ServiceProcess:
        """The gateway, on a free port (``env`` added to its environment)."""
        assert self.gateway is None, "one gateway per Services"
        self._port = free_port()
        self.gateway = self._start(["gateway", "--port", str(self._port)], "gateway.log", env, None)
        return self.gateway

    def start_worker(
        self, stage: int, replica: int = 0, env: dict[str, str] | None = None, nats_url: str | None = None
    ) -> ServiceProcess:
        """A worker of (``stage``, ``replica``), in place of any earlier one (``env`` added to its
        environment; ``nats_url``: its own way to the broker, the services' by default)."""
        ids = {"OMNIRELAY_STAGE": str(stage), "OMNIRELAY_REPLICA": str(replica)}
        proc = self._start(["worker"], f"worker{stage}-{replica}.log", {**ids, **(env or {})}, nats_url)
        self.workers[(stage, replica)] = proc
        return proc

    def start(
        self,
        orchestrators: int = 1,
        gateway: bool = True,
        workers: Iterable[tuple[int, int]] = (),
        worker_env: dict[str, str] | None = None,
        gateway_env: dict[str, str] | None = None,
    ) -> Services:
        """Start ``orchestrators`` orchestrators, the gateway (unless not ``gateway``) and a
        worker of each (stage, replica) of ``workers`` side by side; returns at once."""
        for _ in range(orchestrators):
            self.start_orchestrator()
        if gateway:
            self.start_gateway(gateway_env)
        for stage, replica in workers:
            self.start_worker(stage, replica, worker_env)
        return self

    # --- readiness ----------------------------------------------------------------------------
    def current(self) -> list[ServiceProcess]:
        """The processes that serve the pipeline now: the orchestrators, the gateway, the latest
        worker of each replica."""
        gateway = [] if self.gateway is None else [self.gateway]
        return [*self.orchestrators, *gateway, *self.workers.values()]

    async def ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every one of :meth:`current` serves (the module docstring's three
        conditions); fail at once, with its log's end, if one has exited, and after
        ``timeout_s`` seconds naming what was still missing."""
        nc = await connect(self.nats_url, "tests-pipeline-services")
        try:
            js = nc.jetstream()
            kv = await services_kv(js)
            missing: list[str] = []
            workers: dict[str, int] = {}

            async def registered() -> bool:
                missing[:], found = await self._registered(nc, kv)
                workers.update(found)
                return not missing

            try:
                await until(registered, f"{self.name}'s services registered", timeout_s, POLL_S)
            except AssertionError as e:
                raise AssertionError(f"{e}: no record of {missing}") from None
            for key, revision in workers.items() if self.orchestrators or self.gateway else ():
                await registry_watchers_have(js, key, revision)
            if self.gateway is not None:
                await until(
                    self._health_lists_them, f"{self.base_url}/health listing them", timeout_s, POLL_S
                )
        finally:
            await nc.close()

    async def _registered(self, nc: Client, kv: KeyValue) -> tuple[list[str], dict[str, int]]:
        """The current processes with no record of their own incarnation in ``omni_services``
        yet (by log name), and the registry key and revision of each current worker's record."""
        records: dict[int, tuple[ServiceRecord, int]] = {}
        """Metrics or admin port → (record, its revision), of this pipeline's services."""
        for key in await bucket_keys(nc, SERVICES_BUCKET):
            if key.split(".")[1:2] != [self.name]:
                continue
            with contextlib.suppress(KeyNotFoundError, ValidationError):
                entry = await kv.get(key)
                rec = ServiceRecord.model_validate_json(entry.value or b"")
                port = urlparse(rec.metrics_url).port
                if port is not None:
                    records[port] = (rec, entry.revision or 0)
        missing: list[str] = []
        workers: dict[str, int] = {}
        for proc in self.current():
            self._assert_running(proc)
            rec, revision = records.get(proc.port, (None, 0))
            if rec is None or rec.started_ns < proc.started_ns:
                missing.append(proc.log.name)
            elif rec.service == ServiceKind.WORKER:
                workers[rec.key] = revision
        return missing, workers

    async def _health_lists_them(self) -> bool:
        """Whether the gateway's ``/health`` answers (200 or 503) and counts at least the current
        orchestrators and, per stage, the current workers as live."""
        self._assert_running(self.gateway)
        want = Counter(f"{s}:{self.config.stages[s].name}" for s, _ in self.workers)
        try:
            async with httpx.AsyncClient(timeout=2.0) as http:
                body = (await http.get(f"{self.base_url}/health")).json()
            live = body["stages"]
            return body["orchestrators"] >= len(self.orchestrators) and all(
                live.get(stage, 0) >= n for stage, n in want.items()
            )
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    @staticmethod
    def _assert_running(proc: ServiceProcess | None) -> None:
        """Fail with the end of its log if ``proc`` has exited."""
        assert proc is not None and proc.proc is not None
        code = proc.proc.poll()
        assert code is None, f"{proc.args} exited ({code}) before it served:\n{proc.text()[-3000:]}"

    # --- stopping -----------------------------------------------------------------------------
    def stop(self, check: bool = True) -> None:
        """Stop every process still running, all at once (each continued first: a fault test may
        have left one stopped; ``SIGKILL`` to its process group after 30 s). With ``check``, a
        gateway or orchestrator that was running must have ended as :data:`CLEAN_EXITS` says."""
        running = [p for p in self.processes if p.proc is not None and p.proc.poll() is None]
        stop_left(running)
        unclean = [
            f"{p.args} exited {p.proc.returncode}:\n{p.text()[-2000:]}"
            for p in running
            if p.proc is not None
            and p.proc.returncode not in CLEAN_EXITS.get(ServiceKind(p.args[0]), (p.proc.returncode,))
        ]
        assert not check or not unclean, "\n".join(unclean)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Services:
        """:meth:`ready` from synchronous code (a fixture's set-up); returns the services. On a
        failure every process is stopped first: pytest does not tear down a fixture whose
        set-up failed."""
        try:
            asyncio.run(self.ready(timeout_s))
        except BaseException:
            self.stop(check=False)
            raise
        return self

    @contextlib.contextmanager
    def serving(self, timeout_s: float = READY_TIMEOUT_S) -> Iterator[Services]:
        """Wait until every service serves (:meth:`wait_ready`, up to ``timeout_s`` seconds),
        yield the services, then :meth:`stop` them (unchecked if the block raised)."""
        self.wait_ready(timeout_s)
        try:
            yield self
        except BaseException:
            self.stop(check=False)
            raise
        self.stop()
