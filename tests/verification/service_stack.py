"""The stack as docker compose runs it, without containers: one process per service (every NATS
server, the orchestrator, one ``omnirelay worker`` per stage and replica, the gateway), each
started by this bench under a restart policy like compose's ``restart: unless-stopped`` — a
process that exits, however it ends, is started again with the same command and environment after
Docker's back-off (:func:`restart_delay_s`). ``omnirelay verify faults --mode services`` injects its
faults into such a stack (``--mode up``, the default, into ``omnirelay up``, whose launcher
restarts a process itself).

The commands and environments are the launcher's and the compose file's
(:func:`libs.stack.process_plan.plan_services`; NATS: :mod:`libs.stack.local_nats`). As in a
container, whatever a service started (vLLM's EngineCore) dies with it: its process group is
killed when it exits.

Clocks: ``time.monotonic()`` of this process, seconds. The back-off is a pure function (tested in
``tests/unit/test_fault_suite.py``); the supervision is exercised by the fault suite.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import Managed, Processes, log, wait_http_ok
from libs.common.pipeline import PipelineConfig, load_pipeline
from libs.stack.local_nats import (
    SYNC_INTERVAL,
    ClusterNode,
    client_urls,
    cluster_argvs,
    cluster_nodes,
    free_port,
    nats_server_argv,
)
from libs.stack.process_plan import plan_services

RESTART_FIRST_DELAY_S = 0.1
"""Docker's restart back-off (moby's restart manager): the first delay, seconds ..."""
RESTART_MAX_DELAY_S = 60.0
"""... doubling with each exit in a row, up to this, seconds ..."""
RESTART_RESET_AFTER_S = 10.0
"""... and back to the first once a process ran this long before it exited, seconds."""
EXIT_POLL_S = 0.1
"""How often a supervised process is checked for having exited, seconds."""
STOP_TIMEOUT_S = 30.0
"""How long a service may drain after ``SIGTERM`` before ``SIGKILL`` (compose's
``stop_grace_period``), seconds."""
NATS_HEALTH_TIMEOUT_S = 30.0
"""How long the NATS servers may take to report JetStream healthy, seconds."""
LIVE_TIMEOUT_S = 600.0
"""How long every replica may take to be live behind the gateway at the start, seconds."""


def restart_delay_s(previous_s: float, ran_s: float) -> float:
    """The wait before restarting a process that exited after running ``ran_s`` seconds, when the
    wait before its previous restart was ``previous_s`` (0: none yet). Docker's rule for a
    container with a restart policy: 0.1 s, doubling with every exit in a row up to 60 s; a
    process that ran at least 10 s starts over at 0.1 s."""
    if previous_s <= 0 or ran_s >= RESTART_RESET_AFTER_S:
        return RESTART_FIRST_DELAY_S
    return min(previous_s * 2, RESTART_MAX_DELAY_S)


class Service:
    """One service process and its restart policy: after :meth:`supervise`, a process that exits
    is started again (same command and environment, same log file, appended) after
    :func:`restart_delay_s`, or later while :meth:`hold` says so."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.name, self.argv, self.env, self.log_path = name, list(argv), dict(env), log_path
        self.stop_timeout_s = stop_timeout_s
        self.managed: Managed | None = None
        """The running incarnation (the last one started)."""
        self.started_s = 0.0
        """``time.monotonic()`` at the last start."""
        self.restarts = 0
        self.delay_s = 0.0
        """The policy's wait before the last restart, seconds (0: none yet)."""
        self._not_before_s = 0.0
        """No restart before this ``time.monotonic()`` (``math.inf``: held until :meth:`release`)."""
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        """The pid of the running incarnation."""
        assert self.managed is not None, f"{self.name} was never started"
        return self.managed.proc.pid

    def start(self) -> None:
        """Start the first incarnation (the policy applies from :meth:`supervise` on)."""
        self.managed = self._launch()

    def _launch(self) -> Managed:
        with self.log_path.open("ab") as out:
            proc = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: what it starts dies with it
            )
        self.started_s = time.monotonic()
        return Managed(self.name, proc, self.log_path, signal.SIGTERM, self.stop_timeout_s)

    def _note(self, line: str) -> None:
        """A line of the policy's, in the bench's log and the service's."""
        log(line)
        with contextlib.suppress(OSError), self.log_path.open("a") as f:
            f.write(f"[restart policy] {line}\n")

    def supervise(self) -> None:
        """From now on, restart the process whenever it exits (in a thread of this process)."""
        self._thread = threading.Thread(target=self._keep_running, name=f"policy:{self.name}", daemon=True)
        self._thread.start()

    def _keep_running(self) -> None:
        while not self._stopping.is_set():
            assert self.managed is not None
            proc = self.managed.proc
            if proc.poll() is None:
                self._stopping.wait(EXIT_POLL_S)
                continue
            exited_s = time.monotonic()
            ran_s = exited_s - self.started_s
            self.delay_s = restart_delay_s(self.delay_s, ran_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # as a container's end: vLLM's engine goes too
            self._note(
                f"{self.name} (pid {proc.pid}) exited ({proc.returncode}) after {ran_s:.1f} s; "
                f"restart {self.restarts + 1} in {self.delay_s:g} s"
                + (" (held)" if self._not_before_s > exited_s + self.delay_s else "")
            )
            while time.monotonic() < max(exited_s + self.delay_s, self._not_before_s):
                if self._stopping.wait(0.05):
                    return
            self.managed = self._launch()
            self.restarts += 1
            self._note(f"{self.name} restarted (pid {self.managed.proc.pid}, restart {self.restarts})")

    def hold(self, seconds: float | None = None) -> None:
        """Defer the next restart: until ``seconds`` from now, or (None) until :meth:`release`."""
        self._not_before_s = math.inf if seconds is None else time.monotonic() + seconds

    def release(self) -> None:
        """Let the policy restart the process now, or as soon as its back-off allows."""
        self._not_before_s = 0.0

    def wait_restarted(self, restarts_before: int, timeout_s: float) -> int:
        """Wait until the policy has restarted the process since ``restarts_before`` restarts; the
        new pid. RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.restarts <= restarts_before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not restarted within {timeout_s:.0f} s")
            time.sleep(0.05)
        return self.pid

    def stop(self) -> None:
        """End the supervision, then stop the process (``SIGTERM``, ``SIGKILL`` after
        :attr:`stop_timeout_s`) and what it started."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self.managed is not None:
            self.managed.stop()


@dataclass
class ServiceStack:
    """A stack of one supervised process per service, started by :func:`start_services`; what
    the fault suite needs of a stack (see :class:`benchmarks.harness.Stack`)."""

    name: str
    base_url: str
    """The gateway's OpenAI API, ``http://127.0.0.1:<port>/v1``."""
    nats_url: str
    """Every NATS server's client URL, comma-separated."""
    services: dict[str, Service]
    """By name: ``nats`` (or the cluster's ``nats-1`` ...), ``orchestrator``, ``<stage>-<replica>``,
    ``gateway``."""
    monitors: dict[str, str]
    """Each NATS service's monitoring URL."""
    nats_nodes: tuple[ClusterNode, ...] = ()
    """The cluster's nodes (empty for one server); node ``n`` runs as service ``n.name``."""
    _stopped: bool = field(default=False, repr=False)

    @property
    def root_pid(self) -> int:
        """The process every service descends from: this bench (it started them)."""
        return os.getpid()

    @property
    def log_path(self) -> Path:
        """The log with the orchestrators' lines: the orchestrator service's."""
        return self.services["orchestrator"].log_path

    def stop(self) -> None:
        """Stop the gateway first (no new requests), then the services it fronts, NATS last,
        each group at once (the policy ends first: nothing is restarted)."""
        if self._stopped:
            return
        self._stopped = True
        nats = [s for n, s in self.services.items() if n in self.monitors]
        gateway = [s for n, s in self.services.items() if n == "gateway"]
        rest = [s for s in self.services.values() if s not in nats and s not in gateway]
        for group in (gateway, rest, nats):
            if group:
                log(f"stopping {', '.join(s.name for s in group)}")
                with ThreadPoolExecutor(len(group)) as pool:
                    list(pool.map(Service.stop, group))


def _wait_all_live(stack: ServiceStack, pipeline: PipelineConfig, timeout_s: float) -> float:
    """Poll the gateway's ``/health`` until every planned replica of every stage is live; seconds
    waited. RuntimeError when a service exits meanwhile (before the policy applies, a crash is a
    configuration error) or time runs out."""
    import httpx

    want = {f"{i}:{s.name}": s.replicas for i, s in enumerate(pipeline.stages)}
    url = stack.base_url.removesuffix("/v1") + "/health"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for s in stack.services.values():
            assert s.managed is not None
            if s.managed.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited ({s.managed.proc.returncode}):\n{s.managed.log_tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200 and r.json()["stages"] == want:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not every replica live after {timeout_s:.0f} s")


def start_services(
    procs: Processes,
    name: str,
    pipeline_path: Path,
    data_dir: Path,
    nats_nodes: int = 1,
    sync_interval: str = SYNC_INTERVAL,
    log_stats: bool = True,
) -> ServiceStack:
    """Start NATS (one server, or a cluster of ``nats_nodes``, as ``omnirelay up`` would), then
    the orchestrator, every worker and the gateway of the pipeline at ``pipeline_path``, each its
    own process; once every replica is live, put each under its restart policy. Files (stores,
    one log per service) go under ``data_dir/name``; ``procs`` stops the stack at the end."""
    from libs.models.tiny import make_tiny

    root = data_dir / name.replace(" ", "-")
    root.mkdir(parents=True)
    nats: list[tuple[str, list[str], str]] = []
    nodes: tuple[ClusterNode, ...] = ()
    if nats_nodes == 1:
        nport, mport = free_port(), free_port()
        store = root / "jetstream"
        store.mkdir()
        nats.append(
            ("nats", nats_server_argv(store, nport, mport, sync_interval), f"http://127.0.0.1:{mport}")
        )
        nats_url = f"nats://127.0.0.1:{nport}"
    else:
        nodes = tuple(cluster_nodes(root / "cluster", nats_nodes))
        argvs = cluster_argvs(list(nodes), sync_interval)
        nats += [(n.name, argv, n.monitor_url) for n, argv in zip(nodes, argvs, strict=True)]
        nats_url = client_urls(list(nodes))
    port = free_port()
    stack = ServiceStack(name, f"http://127.0.0.1:{port}/v1", nats_url, {}, {n: m for n, _, m in nats}, nodes)
    procs.stoppers.append(stack.stop)
    for service_name, argv, _ in nats:
        stack.services[service_name] = Service(service_name, argv, {}, root / f"{service_name}.log")
        stack.services[service_name].start()
    for service_name, _, monitor in nats:
        wait_http_ok(stack.services[service_name].managed, f"{monitor}/healthz", NATS_HEALTH_TIMEOUT_S)
    make_tiny()
    pipeline = load_pipeline(pipeline_path)
    log(f"starting {name}: one process per service")
    for spec in plan_services(pipeline, pipeline_path, nats_url, port, log_stats):
        stack.services[spec.name] = Service(spec.name, spec.argv, spec.env, root / f"{spec.name}.log")
        stack.services[spec.name].start()
    log(f"{name} ready in {_wait_all_live(stack, pipeline, LIVE_TIMEOUT_S):.1f} s")
    for service in stack.services.values():
        service.supervise()
    return stack
