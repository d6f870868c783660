"""``omnirelay up``: the whole stack as local processes, with prefixed logs and a clean Ctrl-C.

The process plan (:func:`plan_services`) is a pure function of the pipeline and options so the
compose file can be checked against it: same commands, same environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from libs.common.local_nats import free_port, nats_server_argv
from libs.common.pipeline import PipelineConfig

STOP_TIMEOUT_S = 20.0
HEALTH_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the stack: a name for log prefixes, its ``omnirelay`` arguments and env."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def plan_services(
    pipeline: PipelineConfig, pipeline_path: Path, nats_url: str, port: int, log_stats: bool
) -> list[ServiceSpec]:
    """Orchestrator, one worker per (stage, replica), gateway — in start order."""
    common = {
        "NATS_URL": nats_url,
        "OMNIRELAY_PIPELINE": str(pipeline_path),
        "OMNIRELAY_LOG_STATS": "true" if log_stats else "false",
    }
    specs = [ServiceSpec("orchestrator", ["orchestrator"], dict(common))]
    for s, stage in enumerate(pipeline.stages):
        for r in range(stage.replicas):
            env = {**common, "OMNIRELAY_STAGE": str(s), "OMNIRELAY_REPLICA": str(r)}
            specs.append(ServiceSpec(f"{stage.name}-{r}", ["worker"], env))
    specs.append(ServiceSpec("gateway", ["gateway"], {**common, "OMNIRELAY_PORT": str(port)}))
    return specs


async def _pump(name: str, stream: asyncio.StreamReader, width: int) -> None:
    prefix = f"{name:<{width}} | "
    while line := await stream.readline():
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()


class Stack:
    """Processes started together and stopped together."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, asyncio.subprocess.Process]] = []
        self._pumps: list[asyncio.Task[None]] = []
        self.width = 12

    async def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((name, proc))
        self._pumps.append(asyncio.create_task(_pump(name, proc.stdout, self.width)))

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs if p.returncode is not None]

    async def stop(self) -> None:
        """Stop the gateway first (no new requests), then the services it fronts, NATS last."""
        services = [(n, p) for n, p in self.procs if n != "nats"]
        nats = [(n, p) for n, p in self.procs if n == "nats"]
        for group in (services[-1:], services[:-1], nats):
            await asyncio.gather(*(_terminate(p) for _, p in group))
        for t in self._pumps:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 2)


async def _terminate(p: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL to the whole process group after ``STOP_TIMEOUT_S``."""
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(p.wait(), STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)  # also reaps what the process spawned (vLLM's EngineCore)
    await p.wait()


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


def banner(port: int, nats_url: str, monitor: str | None, model: str) -> str:
    base = f"http://127.0.0.1:{port}"
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    lines = [
        "",
        "omnirelay is up",
        f"  OpenAI API   {base}/v1   (model '{model}')",
        f"  health       {base}/health",
        f"  metrics      {base}/metrics",
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


async def run_stack(
    pipeline: PipelineConfig,
    pipeline_path: Path,
    port: int,
    log_stats: bool,
    data_dir: Path,
    nats_url: str | None,
) -> int:
    """Start everything, print the banner, stream logs until Ctrl-C/SIGTERM or a process dies.

    Signals are handled from the first moment, so an interrupted start still stops what it began.
    """
    from libs.common.signals import shutdown_event

    stop = shutdown_event()
    stack = Stack()
    stack.width = max(len(f"{s.name}-{r}") for s in pipeline.stages for r in range(s.replicas)) + 1
    try:
        starting = asyncio.create_task(
            _start(stack, pipeline, pipeline_path, port, log_stats, data_dir, nats_url)
        )
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        stopping.cancel()
        nats_url, monitor = starting.result()
        print(banner(port, nats_url, monitor, pipeline.served_model_name), flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if dead := stack.dead():
                print(f"omnirelay: {', '.join(dead)} stopped; shutting down", file=sys.stderr)
                return 1
        return 0
    finally:
        await stack.stop()


async def _start(
    stack: Stack,
    pipeline: PipelineConfig,
    pipeline_path: Path,
    port: int,
    log_stats: bool,
    data_dir: Path,
    nats_url: str | None,
) -> tuple[str, str | None]:
    """NATS (unless given), then every service; returns (NATS URL, monitoring URL or None)."""
    from libs.models.tiny import make_tiny

    await asyncio.to_thread(make_tiny)
    monitor = None
    if not nats_url:
        nport, mport = free_port(), free_port()
        store = data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        argv = nats_server_argv(store, nport, mport)
        await stack.spawn("nats", argv, {})
        nats_url, monitor = f"nats://127.0.0.1:{nport}", f"http://127.0.0.1:{mport}"
    for spec in plan_services(pipeline, pipeline_path, nats_url, port, log_stats):
        await stack.spawn(spec.name, [sys.executable, "-m", "cli", *spec.args], spec.env)
    await wait_all_live(f"http://127.0.0.1:{port}/health", pipeline, stack)
    return nats_url, monitor
