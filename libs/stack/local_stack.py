"""A stack as local processes: NATS (one server or a JetStream cluster, unless the stack is given a
URL) and the services of a pipeline as :func:`libs.stack.process_plan.plan_services` plans them,
or ``omnirelay up`` as one process that runs them. ``omnirelay up`` runs its services this way
with its own restart policy and prefixed output; the fault suite runs them this way with Docker's
restart policy and a log file per service; the benchmarks run ``omnirelay up`` under one.

Started in order (NATS healthy first, then the services), judged ready by behaviour (NATS's
``/healthz``, the gateway's ``/health`` counting every planned replica), stopped in order (the
gateway first, so no new request arrives, then the services it fronts, NATS last).

Clocks: ``time.monotonic()`` of this process, seconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from libs.common.pipeline import PipelineConfig, load_pipeline
from libs.stack.forker import Forker, forking_wanted
from libs.stack.local_nats import (
    SYNC_INTERVAL,
    ClusterNode,
    client_urls,
    cluster_argvs,
    cluster_nodes,
    free_port,
    nats_server_argv,
)
from libs.stack.process_plan import SERVICE_IMPORTS, ServiceSpec
from libs.stack.processes import Process, RestartPolicy, copied_to_stdout, wait_for

NATS_HEALTH_TIMEOUT_S = 30.0
"""How long the NATS servers may take to report JetStream healthy (a cluster: to elect a leader)."""
LIVE_TIMEOUT_S = 600.0
"""How long every planned replica may take to be live behind the gateway at the start."""
UP_STOP_TIMEOUT_S = 90.0
"""How long ``omnirelay up`` started as one process may take to stop its services after SIGINT."""


def _note(line: str) -> None:
    print(f"omnirelay: {line}", file=sys.stderr, flush=True)


class Stack:
    """The processes of one stack, by name: ``nats`` (or the cluster's ``nats-1`` ...), then
    ``orchestrator``, ``<stage>-<replica>``, ``gateway`` (or ``up``). Files go under ``root``: the
    NATS stores, and with ``log_dir`` one log per process, else their output reaches stdout
    prefixed with their names."""

    def __init__(
        self,
        root: Path,
        log_dir: Path | None = None,
        note: Callable[[str], None] = _note,
        stop_timeout_s: float = 30.0,
        name: str = "stack",
    ) -> None:
        self.root, self.log_dir, self.note, self.stop_timeout_s = root, log_dir, note, stop_timeout_s
        self.name = name
        """What a bench or suite calls this stack in its output."""
        self.processes: dict[str, Process] = {}
        self.monitors: dict[str, str] = {}
        """Each NATS process's monitoring URL, by name."""
        self.nats_nodes: tuple[ClusterNode, ...] = ()
        """The cluster's nodes (empty for one server); node ``n`` runs as process ``n.name``."""
        self.nats_url = ""
        """Every NATS server's client URL, comma-separated."""
        self.base_url = ""
        """The gateway's root URL (``/health``; the OpenAI API below ``/v1``)."""
        self.prefix_width = 12
        """How wide the name before each copied output line is (without a ``log_dir``)."""
        self._stopping = False
        self.forker: Forker | None = None
        """Where the services are forked from (:meth:`start_forker`); None: each is its own
        ``python`` from the start."""

    def spawn(self, name: str, argv: list[str], env: dict[str, str], **options: object) -> Process:
        """Start ``argv`` as process ``name`` of the stack (options: :class:`Process`'s; a service
        has :attr:`stop_timeout_s` to drain after SIGTERM)."""
        if self._stopping:
            raise RuntimeError(f"{name}: the stack is stopping")
        log = None if self.log_dir is None else self.log_dir / f"{name}.log"
        options = {"prefix_width": self.prefix_width, "stop_timeout_s": self.stop_timeout_s, **options}
        process = Process(name, argv, env, log, **options)  # type: ignore[arg-type]
        self.processes[name] = process.start()
        return process

    @property
    def root_pid(self) -> int:
        """The process every service descends from: ``omnirelay up``, or this one."""
        up = self.processes.get("up")
        return up.pid if up is not None else os.getpid()

    @property
    def log_path(self) -> Path | None:
        """The log with the orchestrators' lines: ``omnirelay up``'s (every service's, prefixed)
        or the orchestrator's."""
        return (self.processes.get("up") or self.processes["orchestrator"]).log_path

    @property
    def api_url(self) -> str:
        """The gateway's OpenAI API (``<base_url>/v1``)."""
        return f"{self.base_url}/v1"

    def _services(self) -> list[Process]:
        return [p for n, p in self.processes.items() if n not in self.monitors]

    def pause(self) -> None:
        """SIGSTOP every process but NATS, and everything they started: a stack a paired bench
        is not measuring does not compete for the cores (an idle vLLM polls shared memory)."""
        for p in self._services():
            p.pause()

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        for p in self._services():
            p.resume()

    def dead(self) -> list[str]:
        """``name (exit 1)`` for each process whose running incarnation has ended."""
        return [e for p in self.processes.values() if (e := p.ended()) is not None]

    def wait(self, check: Callable[[], object], what: str, timeout_s: float, every_s: float = 0.5) -> float:
        """Wait for ``check`` while every process runs; seconds waited. Fails when one exits first
        (before a restart policy applies, a configuration error far more often than a fault), or
        when the stack is being stopped (an interrupted start)."""

        def answer() -> bool:
            if self._stopping:
                raise RuntimeError(f"{what}: the stack is stopping")
            return check()

        t0 = time.monotonic()
        wait_for(answer, what, timeout_s, every_s, watch=list(self.processes.values()))
        return time.monotonic() - t0

    # --- NATS -----------------------------------------------------------------------------------
    def start_nats(
        self,
        nodes: int = 1,
        sync_interval: str = SYNC_INTERVAL,
        conf: str = "",
        route_password: str | None = None,
    ) -> str:
        """One server storing in ``root/jetstream``, or a cluster of ``nodes`` storing in
        ``root/cluster/nats-<i>`` (the same names and stores on every start, so a cluster comes back
        with its streams); ``conf``: configuration text (identities, TLS) for each. Returns once
        every server reports JetStream healthy; the client URLs, comma-separated."""
        if nodes == 1:
            nport, mport = free_port(), free_port()
            store = self.root / "jetstream"
            store.mkdir(parents=True, exist_ok=True)
            self.spawn("nats", nats_server_argv(store, nport, mport, sync_interval, conf), {})
            self.monitors["nats"] = f"http://127.0.0.1:{mport}"
            self.nats_url = f"nats://127.0.0.1:{nport}"
        else:
            self.nats_nodes = tuple(cluster_nodes(self.root / "cluster", nodes))
            argvs = cluster_argvs(list(self.nats_nodes), sync_interval, conf, route_password)
            for node, argv in zip(self.nats_nodes, argvs, strict=True):
                self.spawn(node.name, argv, {})
                self.monitors[node.name] = node.monitor_url
            self.nats_url = client_urls(list(self.nats_nodes))
        for name, monitor in self.monitors.items():
            self.wait(
                lambda m=monitor: http_status(f"{m}/healthz") == 200,
                f"{name} healthy",
                NATS_HEALTH_TIMEOUT_S,
                0.1,
            )
        return self.nats_url

    # --- services -------------------------------------------------------------------------------
    def start_forker(self) -> None:
        """Start the forker the services are forked from (:mod:`libs.stack.forker`), unless
        ``OMNIRELAY_FORKER=off`` or it runs: it imports their code while NATS starts."""
        if self.forker is not None or not forking_wanted():
            return
        if self.log_dir is not None:
            with (self.log_dir / "forker.log").open("ab") as log:
                self.forker = Forker(SERVICE_IMPORTS, log.fileno())
            return
        write = copied_to_stdout("forker", self.prefix_width)
        self.forker = Forker(SERVICE_IMPORTS, write)
        os.close(write)

    def start_services(
        self,
        specs: list[ServiceSpec],
        port: int,
        extra_env: Callable[[ServiceSpec], dict[str, str]] | None = None,
    ) -> None:
        """Start every planned service (``extra_env``: what a service adds to its planned
        environment, such as its NATS identity); the gateway serves on ``port``."""
        self.base_url = f"http://127.0.0.1:{port}"
        self.start_forker()
        for spec in specs:
            env = {**spec.env, **(extra_env(spec) if extra_env else {})}
            self.spawn(spec.name, spec.argv, env, forker=self.forker)

    def start_up(
        self, pipeline_path: Path, env: dict[str, str], up_args: list[str], tree: Path | None = None
    ) -> None:
        """Start ``omnirelay up`` (from checkout ``tree``, default this one) as process ``up``, on
        this stack's NATS, its files under :attr:`root`, its admin listener on any free port."""
        port = free_port()
        argv = [sys.executable, "-m", "cli", "up", "--pipeline", str(pipeline_path), "--port", str(port)]
        argv += ["--data-dir", str(self.root), "--admin-port", "0", *up_args]
        env = {**env, "NATS_URL": self.nats_url}
        if tree is not None:  # `python -m` looks in the working directory first
            env["PYTHONPATH"] = str(tree)
        self.base_url = f"http://127.0.0.1:{port}"
        self.spawn("up", argv, env, stop_signal=signal.SIGINT, stop_timeout_s=UP_STOP_TIMEOUT_S, cwd=tree)

    def wait_all_live(self, pipeline: PipelineConfig | Path, timeout_s: float = LIVE_TIMEOUT_S) -> float:
        """Wait until the gateway's ``/health`` is ready with every planned replica of every stage
        live (it is ready with one per stage); seconds waited."""
        config = pipeline if isinstance(pipeline, PipelineConfig) else load_pipeline(pipeline)
        want = {f"{i}:{s.name}": s.replicas for i, s in enumerate(config.stages)}
        url = f"{self.base_url}/health"
        return self.wait(
            lambda: _health_stages(url) == want, f"every replica live behind {url}", timeout_s, 0.5
        )

    def supervise(self, policy: RestartPolicy) -> None:
        """From now on, start every process that exits again, as ``policy`` says."""
        for process in self.processes.values():
            process.supervise(policy, self.note)

    def stop(self) -> None:
        """Stop the gateway first (no new requests), then the services it fronts, NATS last, each
        group at once (supervision ends first: nothing is restarted). Idempotent."""
        self._stopping = True
        nats = [p for n, p in self.processes.items() if n in self.monitors]
        gateway = [p for n, p in self.processes.items() if n in ("gateway", "up")]
        rest = [p for p in self.processes.values() if p not in nats and p not in gateway]
        for group in (gateway, rest, nats):
            if group:
                with ThreadPoolExecutor(len(group)) as pool:
                    list(pool.map(Process.stop, group))
        if self.forker is not None:
            self.forker.close()


def http_status(url: str) -> int | None:
    """The status of GET ``url`` (2 s timeout); None when it cannot be had."""
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.HTTPError:
        return None


def _health_stages(url: str) -> dict[str, int] | None:
    """The live replicas per stage that a ready gateway's ``/health`` counts; None otherwise."""
    try:
        r = httpx.get(url, timeout=2.0)
        return r.json()["stages"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None
