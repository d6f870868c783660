"""``omnirelay bench capacity``: omnirelay's own ceiling, measured on the mock engine.

The stack is ``omnirelay up`` with ``compose/pipelines/mock-text.yaml`` (a thinker on the mock
engine: every per-token step of omnirelay runs, no model does) plus, for the two-gateway cells, a
second ``omnirelay gateway`` process on the same NATS (gateways are stateless: another process with
ports of its own, as a deployment would add one). Client processes (``--clients``, each a closed
loop of the official openai client, requests round-robin over the cell's gateways) stream chat
completions; per (gateways, concurrency) it prints requests/s, output tokens/s, TTFT and TPOT
p50/p99 (client-side ``time.perf_counter()``, shared by the client processes) and each process's
CPU over the cell (:func:`benchmarks.process_table.process_cpu_s`), naming the process that bounded
the throughput (:func:`bottleneck`). The statistics and the bottleneck rule are pure functions.
vLLM's own server cannot be measured beside it: its pip build ships no fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.comparison_stats import split_requests
from benchmarks.harness import (
    PROMPTS,
    Processes,
    RequestTiming,
    closed_loop,
    log,
    percentile,
    run_with_stacks,
    start_stack,
    timed_request,
    wait_healthy,
)
from benchmarks.paired import table
from benchmarks.process_table import cpu_share_pct, descendants, foreign_cpu_s, process_cpu_s
from libs.common.pipeline import load_pipeline
from libs.stack.local_stack import Stack
from libs.stack.processes import Process

MOCK_PIPELINE = Path(__file__).resolve().parents[1] / "compose" / "pipelines" / "mock-text.yaml"
SATURATED_PCT = 90.0
"""A process using at least this share of one core is saturated (its event loop is one thread)."""
OTHERS = "others"
"""The role of every process this bench did not start (the rest of a shared machine): counted
in the machine's total, never named the bottleneck."""


# --- statistics (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class CellResult:
    """One (gateways, concurrency) cell: its throughput, latencies and per-process CPU."""

    gateways: int
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    """First send to last end over every client process, seconds."""
    req_per_s: float
    tokens_per_s: float
    """Output tokens of successful requests / ``wall_s``."""
    ttft_ms: tuple[float, float] | None
    """(p50, p99), milliseconds."""
    tpot_ms: tuple[float, float] | None
    """(p50, p99), milliseconds."""
    cpu_pct: dict[str, float] = field(default_factory=dict)
    """Role → CPU used over the cell, percent of one core."""
    bottleneck: str = ""
    error_sample: str | None = None


def _p50_p99(values: Sequence[float]) -> tuple[float, float] | None:
    return (percentile(values, 50) * 1e3, percentile(values, 99) * 1e3) if values else None


def cell_result(
    gateways: int,
    concurrency: int,
    timings: Sequence[RequestTiming],
    cpu_pct: dict[str, float],
    cores: int,
) -> CellResult:
    """The figures of one cell from every request's timing and the roles' CPU (percent of a core)."""
    good = [t for t in timings if t.ok]
    wall = max(t.done_s for t in timings) - min(t.sent_s for t in timings) if timings else 0.0
    errors = [t.error for t in timings if not t.ok]
    return CellResult(
        gateways=gateways,
        concurrency=concurrency,
        requests=len(timings),
        errors=len(errors),
        wall_s=wall,
        req_per_s=len(good) / wall if wall > 0 else 0.0,
        tokens_per_s=sum(t.tokens for t in good) / wall if wall > 0 else 0.0,
        ttft_ms=_p50_p99([t.ttft_s for t in good if t.ttft_s is not None]),
        tpot_ms=_p50_p99([t.tpot_s for t in good if t.tpot_s is not None]),
        cpu_pct=dict(cpu_pct),
        bottleneck=bottleneck(cpu_pct, cores),
        error_sample=errors[0] if errors else None,
    )


def bottleneck(cpu_pct: dict[str, float], cores: int, saturated_pct: float = SATURATED_PCT) -> str:
    """Which process bounded the cell, from each role's CPU (percent of one core; a role of
    several processes, such as the clients, is their sum): the busiest single-threaded process
    when it used ``saturated_pct`` of a core or more; else the machine when all together used that
    share of its ``cores`` (processes this bench did not start, :data:`OTHERS`, included); else
    none (the load itself, or waiting, set the pace)."""
    own = {k: v for k, v in cpu_pct.items() if k != OTHERS}
    if not own:
        return "unknown (no CPU readings)"
    role, top = max(own.items(), key=lambda kv: kv[1])
    total = sum(cpu_pct.values())
    if top >= saturated_pct and not role.startswith("clients"):
        return f"{role} ({top:.0f}% of a core)"
    if total >= saturated_pct * cores:
        others = f", {cpu_pct[OTHERS]:.0f}% by other processes" if cpu_pct.get(OTHERS) else ""
        return f"the machine: {total:.0f}% of {cores} cores busy, most in {role} ({top:.0f}%){others}"
    if top >= saturated_pct:
        return f"the load generator: {role} {top:.0f}% (add --clients)"
    return f"no process saturated (busiest {role} {top:.0f}%, all {total:.0f}% of {cores} cores)"


def _ms(pair: tuple[float, float] | None) -> tuple[str, str]:
    return ("-", "-") if pair is None else (f"{pair[0]:.1f}", f"{pair[1]:.1f}")


def render(cells: Sequence[CellResult]) -> str:
    """Two tables (throughput and latency; CPU per process, percent of one core), then one line
    per cell naming its bottleneck."""
    perf = table(
        ("gateways", "c", "requests", "errors", "req/s", "out tok/s", "TTFT p50", "p99", "TPOT p50", "p99"),
        [
            (
                str(r.gateways),
                str(r.concurrency),
                str(r.requests),
                str(r.errors),
                f"{r.req_per_s:.1f}",
                f"{r.tokens_per_s:.0f}",
                *_ms(r.ttft_ms),
                *_ms(r.tpot_ms),
            )
            for r in cells
        ],
        left=0,
    )
    roles = sorted({k for r in cells for k in r.cpu_pct})
    cpu = table(
        ("gateways", "c", *roles),
        [
            (str(r.gateways), str(r.concurrency), *(f"{r.cpu_pct.get(k, 0):.0f}" for k in roles))
            for r in cells
        ],
        left=0,
    )
    notes = [f"g={r.gateways} c={r.concurrency}: bottleneck {r.bottleneck}" for r in cells]
    notes += [
        f"g={r.gateways} c={r.concurrency}: {r.errors} failed, e.g. {r.error_sample}"
        for r in cells
        if r.errors
    ]
    head = "latencies in ms; TTFT/TPOT from the client"
    return "\n".join([head, perf, "", "CPU over the cell, % of one core", cpu, "", *notes])


# --- load (client processes) ----------------------------------------------------------------------


async def _client_load(
    base_urls: Sequence[str], model: str, requests: int, concurrency: int, max_tokens: int, offset: int
) -> list[RequestTiming]:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=u, api_key="bench", timeout=300.0, max_retries=0) for u in base_urls]

    def one(i: int) -> Awaitable[RequestTiming]:
        i += offset
        return timed_request(clients[i % len(clients)], model, PROMPTS[i % len(PROMPTS)], max_tokens)

    try:
        return (await closed_loop(requests, concurrency, one))[1]
    finally:
        for c in clients:
            await c.close()


def client_job(
    base_urls: Sequence[str], model: str, requests: int, concurrency: int, max_tokens: int, offset: int
) -> list[RequestTiming]:
    """One client process's share of a cell (run in a pool process): a closed loop of
    ``concurrency`` users, ``requests`` in all, request i to ``base_urls[i % len]``."""
    return asyncio.run(_client_load(base_urls, model, requests, concurrency, max_tokens, offset))


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityOptions:
    """What ``omnirelay bench capacity`` runs (see the CLI for meanings)."""

    pipeline_path: Path = MOCK_PIPELINE
    gateways: tuple[int, ...] = (1, 2)
    concurrency: tuple[int, ...] = (64, 256)
    requests: int | None = None
    """Per cell; None: 5 × the concurrency."""
    max_tokens: int = 64
    clients: int = 2
    warmup: int = 64
    json_path: Path | None = None
    keep_logs: bool = False


def _role(cmdline: str) -> str:
    """What a process of the stack is, from its command line."""
    args = cmdline.split()
    if any(Path(a).name == "nats-server" for a in args[:1]):
        return "nats"
    if "cli" in args and args.index("cli") + 1 < len(args):
        return args[args.index("cli") + 1]  # up, gateway, orchestrator, worker
    return Path(args[0]).name if args else "?"


def stack_roles(stack: Stack, second: Process | None, pool_pids: Sequence[int]) -> dict[str, list[int]]:
    """Role → pids: every process of the stack (``up`` and its services, NATS), the second
    gateway, the client processes and this bench."""
    import psutil

    roles: dict[str, list[int]] = {}
    nats_pids = [stack.processes[name].pid for name in stack.monitors]
    for pid in [stack.root_pid, *descendants(stack.root_pid), *nats_pids]:
        try:
            role = _role(" ".join(psutil.Process(pid).cmdline()))
        except psutil.Error:
            continue
        role = "gateway-1" if role == "gateway" else role
        roles.setdefault(role, []).append(pid)
    if second is not None:
        roles["gateway-2"] = [second.pid]
    roles[f"clients ({len(pool_pids)})"] = list(pool_pids)
    roles["bench"] = [os.getpid()]
    return roles


def roles_cpu_s(roles: dict[str, list[int]]) -> dict[str, float]:
    """Role → CPU seconds its living processes have used so far (:func:`process_cpu_s`)."""
    out: dict[str, float] = {}
    for role, pids in roles.items():
        total = 0.0
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                total += process_cpu_s(pid)
        out[role] = total
    return out


def stack_env(concurrency: Sequence[int]) -> dict[str, str]:
    """The services' settings for the bench: a worker takes every request of the highest
    concurrency at once (``OMNIRELAY_MAX_INFLIGHT``, default 128, so the engine's ``max_num_seqs``
    is the only queue) and the gateways do not cap one client address
    (``OMNIRELAY_MAX_CONCURRENT_PER_KEY``, default 256)."""
    return {"OMNIRELAY_MAX_INFLIGHT": str(max(128, *concurrency)), "OMNIRELAY_MAX_CONCURRENT_PER_KEY": "0"}


def _start_second_gateway(
    procs: Processes, stack: Stack, pipeline_path: Path, env: dict[str, str]
) -> tuple[Process, str]:
    """Another ``omnirelay gateway`` on the stack's NATS; (its process, its ``/v1`` URL)."""
    from libs.stack.local_nats import free_port

    port, admin = free_port(), free_port()
    env = {
        **env,
        "NATS_URL": stack.nats_url,
        "OMNIRELAY_PIPELINE": str(pipeline_path),
        "OMNIRELAY_PORT": str(port),
        "OMNIRELAY_ADMIN_PORT": str(admin),
    }
    gw = procs.start("gateway-2", [sys.executable, "-m", "cli", "gateway"], env, signal.SIGTERM)
    wait_healthy(gw, port, 120)
    return gw, f"http://127.0.0.1:{port}/v1"


def _measure(
    opts: CapacityOptions, urls: list[str], model: str, roles_of, pool: ProcessPoolExecutor
) -> list[CellResult]:
    cores = len(os.sched_getaffinity(0))
    for url in urls:  # every gateway, the client processes and the worker warm
        jobs = [
            pool.submit(client_job, [url], model, n, max(1, min(64, n)), opts.max_tokens, i)
            for i, n in enumerate(split_requests(opts.warmup, opts.clients))
        ]
        if failed := [t.error for j in jobs for t in j.result() if not t.ok]:
            raise RuntimeError(f"warm-up through {url} failed: {failed[0]}")
    log(f"warm-up done ({opts.warmup} requests per gateway)")
    cells = []
    for g in opts.gateways:
        for c in opts.concurrency:
            total = opts.requests or 5 * c
            roles = roles_of()
            before, others0 = roles_cpu_s(roles), foreign_cpu_s()
            w0 = time.monotonic()
            shares, users = split_requests(total, opts.clients), split_requests(c, opts.clients)
            jobs = [
                pool.submit(client_job, urls[:g], model, n, u, opts.max_tokens, sum(shares[:i]))
                for i, (n, u) in enumerate(zip(shares, users, strict=True))
                if n > 0
            ]
            timings = [t for j in jobs for t in j.result()]
            wall = time.monotonic() - w0
            after = roles_cpu_s(roles)
            cpu = {r: 100.0 * max(after[r] - before.get(r, 0.0), 0.0) / wall for r in after}
            cpu[OTHERS] = cpu_share_pct(others0, foreign_cpu_s(), wall)
            cell = cell_result(g, c, timings, cpu, cores)
            log(
                f"g={g} c={c}: {cell.requests} requests, {cell.errors} errors, {cell.req_per_s:.1f} req/s, "
                f"{cell.tokens_per_s:.0f} tok/s; bottleneck {cell.bottleneck}"
            )
            cells.append(cell)
    return cells


def run_capacity_bench(opts: CapacityOptions) -> int:
    """Start the mock stack (and a second gateway when a cell needs it), measure every cell,
    print the tables; 0 on success, 1 on failure (every process started is stopped)."""
    pipeline = load_pipeline(opts.pipeline_path)
    if any(s.engine.mock is None for s in pipeline.stages):
        log(f"warning: {pipeline.source} has stages on a real engine: this measures them too")
    model = pipeline.served_model_name

    def work(procs: Processes, data_dir: Path) -> None:
        env = stack_env(opts.concurrency)
        stack = start_stack(procs, "mock stack", opts.pipeline_path, env, data_dir)
        urls = [stack.api_url]
        second = None
        if max(opts.gateways) > 1:
            second, url2 = _start_second_gateway(procs, stack, opts.pipeline_path, env)
            urls.append(url2)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(opts.clients, mp_context=ctx) as pool:

            def roles_of() -> dict[str, list[int]]:
                pool_pids = [p.pid for p in pool._processes.values()]  # the pool's own processes
                return stack_roles(stack, second, pool_pids)

            cells = _measure(opts, urls, model, roles_of, pool)
        print(render(cells), flush=True)
        if opts.json_path:
            opts.json_path.write_text(json.dumps([asdict(c) for c in cells], indent=2))
            log(f"raw numbers written to {opts.json_path}")

    return run_with_stacks("omnirelay-capacity-", work, keep=opts.keep_logs)
