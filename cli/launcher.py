"""``omnirelay up``: the whole stack as local processes, with prefixed logs, a process that dies
restarted with back-off, and a clean Ctrl-C.

The process plan (:func:`plan_services`, from :mod:`libs.stack.process_plan`) is a pure function of
the pipeline and options so the compose file can be checked against it: same commands, same
environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from cli.stack_file import StackInfo, remove_stack_file, write_stack_file
from libs.common.nats_identities import OPERATOR, worker_identity
from libs.common.pipeline import PipelineConfig
from libs.stack.local_nats import (
    SYNC_INTERVAL,
    client_urls,
    cluster_argvs,
    cluster_nodes,
    free_port,
    nats_server_argv,
)
from libs.stack.nats_security import SECRETS_DIR, NatsSecurity, prepare
from libs.stack.process_plan import ServiceSpec, plan_services

STOP_TIMEOUT_S = 20.0
HEALTH_TIMEOUT_S = 600.0
NATS_HEALTH_TIMEOUT_S = 30.0
"""How long the local NATS servers may take to report JetStream healthy, seconds."""


@dataclass(frozen=True)
class NatsOptions:
    """The NATS ``omnirelay up`` starts: how many servers (1, or a JetStream cluster of 3 or 5)
    and their ``sync_interval``."""

    nodes: int = 1
    sync_interval: str = SYNC_INTERVAL


async def _pump(name: str, stream: asyncio.StreamReader, width: int) -> None:
    """Copy a child's output to ours, each line prefixed with its name; a last line without a
    newline gets one, so the next process's line starts on a line of its own."""
    prefix = f"{name:<{width}} | "
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over the reader's limit (64 KiB), which it has dropped
            # Reading on matters: a pump that stopped would leave the child blocked on a full pipe.
            line = b"[a line over 64 KiB was cut]\n"
        if not line:
            break
        text = line.decode(errors="replace")
        sys.stdout.write(prefix + text + ("" if text.endswith("\n") else "\n"))
        sys.stdout.flush()


RESTART_FIRST_DELAY_S = 0.5
"""Back-off before restarting a process that died: this, doubling with each death in a row."""
RESTART_MAX_DELAY_S = 30.0
"""... up to this, seconds."""
EXIT_POLL_S = 0.1
"""How often a supervised process is checked for having exited, seconds."""
STABLE_AFTER_S = 60.0
"""A process that ran this long before it died starts its back-off over (it was not crash-looping)."""


def restart_delay(deaths_in_a_row: int) -> float:
    """Seconds to wait before restart number ``deaths_in_a_row`` (1 = the first death after a
    stable run): 0.5, 1, 2, 4, ... capped at :data:`RESTART_MAX_DELAY_S`."""
    return min(RESTART_FIRST_DELAY_S * 2 ** max(deaths_in_a_row - 1, 0), RESTART_MAX_DELAY_S)


def exit_status(returncode: int) -> str:
    """A process's end as an operator reads it: ``exit 1`` or ``signal 9 (SIGKILL)``."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {-returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"signal {-returncode}"


@dataclass
class Child:
    """One process of the stack and how to start it again."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: asyncio.subprocess.Process | None = None
    started_s: float = 0.0
    """``time.monotonic()`` at the last start."""
    restarts: int = 0
    deaths_in_a_row: int = 0


class Stack:
    """Processes started together, kept running (a process that dies is restarted with back-off,
    once the stack is up), and stopped together."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.width = 12

    async def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        child = Child(name, argv, env)
        self.children.append(child)
        await self._launch(child)

    async def _launch(self, child: Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv,
            env={**os.environ, **child.env, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        child.started_s = time.monotonic()
        self._tasks.append(asyncio.create_task(_pump(child.name, child.proc.stdout, self.width)))

    def dead(self) -> list[str]:
        return [
            f"{c.name} ({exit_status(c.proc.returncode)})"
            for c in self.children
            if c.proc is not None and c.proc.returncode is not None
        ]

    def supervise(self) -> None:
        """From now on, restart every process that dies (see :meth:`_keep_running`)."""
        self._tasks += [asyncio.create_task(self._keep_running(c)) for c in self.children]

    async def _keep_running(self, child: Child) -> None:
        """Wait for ``child`` to die, then start it again with the same command and environment
        (so a worker takes its stage, replica and durable consumer back) after
        :func:`restart_delay`; logs which process, how it ended and the restart number."""
        while not self._stopping:
            assert child.proc is not None
            code = await _exited(child.proc)
            if self._stopping:
                return
            ran_s = time.monotonic() - child.started_s
            child.deaths_in_a_row = 1 if ran_s >= STABLE_AFTER_S else child.deaths_in_a_row + 1
            delay = restart_delay(child.deaths_in_a_row)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)  # what it spawned (vLLM's engine) goes too
            print(
                f"omnirelay: {child.name} (pid {child.proc.pid}) ended with {exit_status(code)} after "
                f"{ran_s:.1f} s; restart {child.restarts + 1} in {delay:g} s",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._launch(child)
            child.restarts += 1
            print(
                f"omnirelay: {child.name} restarted (pid {child.proc.pid}, restart {child.restarts})",
                file=sys.stderr,
                flush=True,
            )

    async def stop(self) -> None:
        """Stop the gateway first (no new requests), then the services it fronts, NATS last."""
        self._stopping = True
        procs = [(c.name, c.proc) for c in self.children if c.proc is not None]
        services = [p for n, p in procs if not n.startswith("nats")]
        nats = [p for n, p in procs if n.startswith("nats")]
        for group in (services[-1:], services[:-1], nats):
            await asyncio.gather(*(_terminate(p) for p in group))
        for t in self._tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(t, 2)


async def _exited(p: asyncio.subprocess.Process) -> int:
    """``p``'s return code once it has exited.

    Not ``p.wait()``: on Python 3.11 that returns only once every pipe of the process is closed,
    and what the process spawned (vLLM's engine processes, which outlive a killed worker for a
    while) holds its stdout. The return code is set as soon as the process is reaped.
    """
    while p.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)
    return p.returncode


async def _terminate(p: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL to the whole process group after ``STOP_TIMEOUT_S``."""
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_exited(p), STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)  # also reaps what the process spawned (vLLM's EngineCore)
    await _exited(p)


async def wait_all_live(
    url: str, pipeline: PipelineConfig, stack: Stack, timeout_s: float = HEALTH_TIMEOUT_S
) -> None:
    """Poll the gateway's ``/health`` until it is ready with every planned replica of every stage
    live (``/health`` itself is ready with one per stage); fail early if a process dies."""
    want = {f"{i}:{s.name}": s.replicas for i, s in enumerate(pipeline.stages)}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if dead := stack.dead():
                raise RuntimeError(f"process(es) exited during start: {', '.join(dead)}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await client.get(url)
                if r.status_code == 200 and r.json()["stages"] == want:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url}: not every replica live after {timeout_s:.0f} s")


async def wait_nats_healthy(
    monitors: list[str], stack: Stack, timeout_s: float = NATS_HEALTH_TIMEOUT_S
) -> None:
    """Poll every server's ``/healthz`` (200 once its JetStream is ready: in a cluster, once the
    servers have elected a leader) so the services find JetStream at their start; fail early if a
    server dies."""
    deadline = time.monotonic() + timeout_s
    pending = list(monitors)
    async with httpx.AsyncClient(timeout=2.0) as client:
        while pending and time.monotonic() < deadline:
            if dead := stack.dead():
                raise RuntimeError(f"process(es) exited during start: {', '.join(dead)}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{pending[0]}/healthz")).status_code == 200:
                    pending.pop(0)
                    continue
            await asyncio.sleep(0.1)
    if pending:
        raise RuntimeError(f"NATS not healthy after {timeout_s:.0f} s: {', '.join(pending)}")


def banner(port: int, nats_url: str, monitor: str | None, model: str, admin_port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    admin = f"http://127.0.0.1:{admin_port}"
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    lines = [
        "",
        "omnirelay is up",
        f"  OpenAI API   {base}/v1   (model '{model}')",
        f"  health       {base}/health",
        f"  metrics      {admin}/metrics   (the gateway's admin port: no API key, this machine only)",
        f"  targets      {admin}/prometheus/targets   (Prometheus service discovery)",
        f"  NATS         {nats_url}" + (f"   monitoring {monitor}" if monitor else ""),
        "",
        "try:",
        f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{json.dumps(body)}'",
        "",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def announce(
    data_dir: Path,
    port: int,
    nats_url: str,
    monitor: str | None,
    pipeline: str,
    pipeline_path: Path,
    security: NatsSecurity | None = None,
    admin_port: int | None = None,
) -> Path:
    """Write ``<data_dir>/stack.json`` for the stack this process runs (NATS client and monitoring
    URLs, comma-separated, the gateway on ``port`` and its admin listener on ``admin_port``, and
    where the operator identity's secret is when the launcher's NATS has identities); its path."""
    me = psutil.Process()
    operator = None if security is None else security.env(OPERATOR)
    admin = f"http://127.0.0.1:{admin_port}" if admin_port else None
    monitors = monitor.split(",") if monitor else []
    info = StackInfo(
        me.pid,
        me.create_time(),
        nats_url,
        monitors,
        f"http://127.0.0.1:{port}",
        pipeline,
        str(pipeline_path),
        operator,
        admin,
    )
    return write_stack_file(data_dir, info)


def service_identity(spec: ServiceSpec) -> str:
    """The NATS identity of a planned service: ``gateway``, ``orchestrator``, ``worker-<s>-<r>``."""
    if spec.args[0] == "worker":
        return worker_identity(int(spec.env["OMNIRELAY_STAGE"]), int(spec.env["OMNIRELAY_REPLICA"]))
    return spec.args[0]


async def run_stack(
    pipeline: PipelineConfig,
    pipeline_path: Path,
    port: int,
    log_stats: bool,
    data_dir: Path,
    nats_url: str | None,
    nats: NatsOptions | None = None,
    admin_port: int = 0,
) -> int:
    """Start NATS (unless ``nats_url`` is given) with one identity per role
    (:mod:`libs.common.nats_identities`, secrets under ``<data_dir>/nats-secrets``), then every
    service with its own; print the banner and stream logs until Ctrl-C/SIGTERM. A process that
    dies during start fails the start (a configuration error far more often than a fault); once the
    stack is up it is restarted (:meth:`Stack.supervise`). Signals are handled from the first
    moment, so an interrupted start stops what it began. The gateway's admin listener takes
    ``admin_port`` (0: a free port); ``<data_dir>/stack.json`` (:mod:`cli.stack_file`) says where
    the stack is while it runs."""
    from libs.common.signals import shutdown_event
    from libs.models.tiny import make_tiny

    stop = shutdown_event()
    stack = Stack()
    stack.width = max(len(f"{s.name}-{r}") for s in pipeline.stages for r in range(s.replicas)) + 1
    admin_port = admin_port or free_port()

    async def start() -> tuple[str, str | None, NatsSecurity | None]:
        await asyncio.to_thread(make_tiny)
        url, monitor, security = nats_url, None, None
        if not url:
            security = await asyncio.to_thread(prepare, data_dir / SECRETS_DIR, pipeline)
            url, monitors = await _start_nats(stack, data_dir, nats or NatsOptions(), security)
            monitor = ",".join(monitors)
            await wait_nats_healthy(monitors, stack)
        for spec in plan_services(pipeline, pipeline_path, url, port, log_stats, admin_port):
            env = spec.env if security is None else {**spec.env, **security.env(service_identity(spec))}
            await stack.spawn(spec.name, spec.argv, env)
        await wait_all_live(f"http://127.0.0.1:{port}/health", pipeline, stack)
        return url, monitor, security

    try:
        starting = asyncio.create_task(start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        stopping.cancel()
        url, monitor, security = starting.result()
        print(banner(port, url, monitor, pipeline.served_model_name, admin_port), flush=True)
        stack.supervise()
        announce(data_dir, port, url, monitor, pipeline.name, pipeline_path, security, admin_port)
        await stop.wait()
        return 0
    finally:
        remove_stack_file(data_dir, os.getpid())
        await stack.stop()


async def _start_nats(
    stack: Stack, data_dir: Path, nats: NatsOptions, security: NatsSecurity | None = None
) -> tuple[str, list[str]]:
    """One server storing in ``data_dir/jetstream``, or a cluster of ``nats.nodes`` storing in
    ``data_dir/cluster/nats-<i>`` (the same server names and stores on every start, so a cluster
    comes back with its streams); with ``security``, its identities (and routes that authenticate);
    returns (client URLs comma-separated, monitoring URLs)."""
    conf = "" if security is None else security.server_conf
    if nats.nodes == 1:
        nport, mport = free_port(), free_port()
        store = data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        await stack.spawn("nats", nats_server_argv(store, nport, mport, nats.sync_interval, conf), {})
        return f"nats://127.0.0.1:{nport}", [f"http://127.0.0.1:{mport}"]
    nodes = cluster_nodes(data_dir / "cluster", nats.nodes)
    route_pw = None if security is None else security.route_password
    for node, argv in zip(nodes, cluster_argvs(nodes, nats.sync_interval, conf, route_pw), strict=True):
        await stack.spawn(node.name, argv, {})
    return client_urls(nodes), [n.monitor_url for n in nodes]
