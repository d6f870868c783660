"""``omnirelay up``: the whole stack as local processes (:class:`libs.stack.local_stack.Stack`),
with prefixed logs, a process that dies restarted with back-off, and a clean Ctrl-C.

The process plan (:func:`plan_services`, from :mod:`libs.stack.process_plan`) is a pure function of
the pipeline and options so the compose file can be checked against it: same commands, same
environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from cli.stack_file import StackInfo, remove_stack_file, write_stack_file
from libs.common.nats_identities import OPERATOR, worker_identity
from libs.common.pipeline import PipelineConfig
from libs.stack.local_nats import SYNC_INTERVAL, free_port
from libs.stack.local_stack import Stack
from libs.stack.nats_security import SECRETS_DIR, NatsSecurity, prepare
from libs.stack.process_plan import ServiceSpec, plan_services
from libs.stack.processes import LAUNCHER_RESTARTS

STOP_TIMEOUT_S = 20.0
"""How long a service may drain after SIGTERM before it is killed, seconds."""


@dataclass(frozen=True)
class NatsOptions:
    """The NATS ``omnirelay up`` starts: how many servers (1, or a JetStream cluster of 3 or 5)
    and their ``sync_interval``."""

    nodes: int = 1
    sync_interval: str = SYNC_INTERVAL


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


def _start(
    stack: Stack,
    pipeline: PipelineConfig,
    pipeline_path: Path,
    port: int,
    log_stats: bool,
    data_dir: Path,
    nats_url: str | None,
    nats: NatsOptions | None,
    admin_port: int,
) -> NatsSecurity | None:
    """Start NATS (unless ``nats_url`` is given) and every service, and wait until each planned
    replica is live; the NATS identities made for them (None with an outside NATS)."""
    from libs.models.tiny import make_tiny

    stack.start_forker()  # it imports the services' code while the rest starts
    make_tiny()
    security = None
    if nats_url:
        stack.nats_url = nats_url
    else:
        security = prepare(data_dir / SECRETS_DIR, pipeline)
        options = nats or NatsOptions()
        stack.start_nats(options.nodes, options.sync_interval, security.server_conf, security.route_password)
    specs = plan_services(pipeline, pipeline_path, stack.nats_url, port, log_stats, admin_port)
    stack.start_services(
        specs, port, None if security is None else lambda s: security.env(service_identity(s))
    )
    stack.wait_all_live(pipeline)
    return security


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
    stack is up it is restarted (:data:`LAUNCHER_RESTARTS`). Signals are handled from the first
    moment, so an interrupted start stops what it began. The gateway's admin listener takes
    ``admin_port`` (0: a free port); ``<data_dir>/stack.json`` (:mod:`cli.stack_file`) says where
    the stack is while it runs."""
    from libs.common.signals import shutdown_event

    stop = shutdown_event()
    stack = Stack(data_dir, stop_timeout_s=STOP_TIMEOUT_S)
    stack.prefix_width = max(len(f"{s.name}-{r}") for s in pipeline.stages for r in range(s.replicas)) + 1
    admin_port = admin_port or free_port()

    def start() -> NatsSecurity | None:
        return _start(stack, pipeline, pipeline_path, port, log_stats, data_dir, nats_url, nats, admin_port)

    try:
        starting = asyncio.ensure_future(asyncio.to_thread(start))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            await asyncio.to_thread(stack.stop)  # the start's waits fail at once
            with contextlib.suppress(Exception):
                await starting
            return 130
        stopping.cancel()
        security = starting.result()
        monitor = ",".join(stack.monitors.values()) or None
        print(banner(port, stack.nats_url, monitor, pipeline.served_model_name, admin_port), flush=True)
        stack.supervise(LAUNCHER_RESTARTS)
        announce(data_dir, port, stack.nats_url, monitor, pipeline.name, pipeline_path, security, admin_port)
        await stop.wait()
        return 0
    finally:
        remove_stack_file(data_dir, os.getpid())
        await asyncio.to_thread(stack.stop)
