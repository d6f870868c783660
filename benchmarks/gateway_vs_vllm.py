"""``omnirelay bench gateway``: the gateway against vLLM's own OpenAI server, side by side, in one run.

Both targets serve the same thinker with the same engine settings and core: ``omnirelay up`` with a
thinker-only pipeline (``compose/pipelines/text-only.yaml``) and ``python -m
vllm.entrypoints.openai.api_server``. Both start up front, then take turns in paired rounds
(:mod:`benchmarks.paired`), every concurrency in every round; the target not being measured is
frozen (SIGSTOP: an idle vLLM polls shared memory on the engines' core) and a resumed one must be
healthy and answer a few unmeasured requests first (:func:`measure_targets`, which ``bench vllm``
shares). By default the engines run on one core and everything else on the others
(:func:`~benchmarks.harness.isolate_engines`). The difference is what the gateway, the orchestrator
and the bus add to a single-stage text request.

Per request, client-side ``time.perf_counter()`` seconds: TTFT (first content chunk − send), TPOT
((last content chunk − first) ÷ (output tokens − 1)) and e2e; per round and target their p50, p90
and mean and the throughput (:data:`benchmarks.comparison_stats.FIGURES`), compared omnirelay ÷ vLLM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

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
    start_stack,
    wait_healthy,
)
from benchmarks.paired import Figure, Paired, render, run_paired, settle, write_json
from benchmarks.process_table import cpu_share_pct, foreign_cpu_s, machine_activity
from libs.common.pipeline import PipelineConfig, load_pipeline
from libs.stack.local_nats import SYNC_INTERVAL

if TYPE_CHECKING:
    from openai import AsyncOpenAI

T = TypeVar("T")


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
    isolate_engines: bool = True
    """Engines on the engine core, everything else on the other cores (see :func:`isolate_engines`)."""
    nats_sync_interval: str = SYNC_INTERVAL
    """JetStream ``sync_interval`` of the stack's NATS server."""


async def _wait_ready(target: Target, timeout_s: float = 60.0) -> None:
    """Poll ``target``'s ``/health`` until it answers 200 (after a resume, the omnirelay services
    re-register within a heartbeat)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(target.base_url.removesuffix("/v1") + "/health")).status_code == 200:
                    return
            if target.process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{target.name} not healthy after resume:\n{target.process.log_tail()}")
            await asyncio.sleep(0.2)


async def measure_targets(
    targets: dict[str, Target],
    concurrency: Sequence[int],
    rounds: int,
    one: Callable[[str, int, int, AsyncOpenAI], Awaitable[T]],
    figures: Sequence[Figure[T]],
    warmup: int,
    max_tokens: int,
    in_a_row: int = 2,
) -> Paired[T]:
    """The paired rounds of omnirelay against vLLM at every ``concurrency``: ``one(target,
    concurrency, round, client)`` measures a run. Every target is paused but the one measured,
    which is resumed, healthy and has answered ``in_a_row`` unmeasured requests in a row first (a long
    pause lets the omnirelay registrations expire; they come back with the next heartbeat). The
    warm-up of each is ``warmup`` requests at the highest concurrency, all of which must succeed."""
    from openai import AsyncOpenAI

    clients = {
        name: AsyncOpenAI(base_url=t.base_url, api_key="bench", timeout=300.0, max_retries=0)
        for name, t in targets.items()
    }

    @contextlib.asynccontextmanager
    async def active(name: str) -> AsyncIterator[None]:
        targets[name].process.resume()
        try:
            await _wait_ready(targets[name])
            await settle(name, targets[name].model, clients[name], in_a_row, max_tokens)
            yield
        finally:
            targets[name].process.pause()

    async def warm_up(name: str) -> None:
        t0 = time.monotonic()
        _, timings = await run_load(clients[name], targets[name].model, warmup, max(concurrency), max_tokens)
        log(f"warm-up {name}: {len(timings)} requests in {time.monotonic() - t0:.1f} s")
        if failed := [x.error for x in timings if not x.ok]:
            raise RuntimeError(f"warm-up of {name} failed: {failed[0]}")

    try:
        for t in targets.values():
            t.process.pause()
        return await run_paired(
            (GATEWAY, DIRECT),
            {f"c={c}": c for c in concurrency},
            rounds,
            lambda name, c, r: one(name, c, r, clients[name]),
            baseline=DIRECT,
            active=active,
            warmup=warm_up,
            figures=figures,
        )
    finally:
        for client in clients.values():
            await client.close()


async def measure(targets: dict[str, Target], opts: BenchOptions) -> Paired[RoundResult]:
    """The paired rounds of ``bench gateway``: each run ``opts.requests`` ÷ ``opts.rounds`` streamed
    requests, with what else used the machine meanwhile."""

    async def one(name: str, concurrency: int, r: int, client: AsyncOpenAI) -> RoundResult:
        n = split_requests(opts.requests or default_requests(concurrency), opts.rounds)[r]
        machine, cpu0 = machine_activity(), foreign_cpu_s()
        wall, timings = await run_load(client, targets[name].model, n, concurrency, opts.max_tokens)
        machine["foreign_cpu_pct"] = cpu_share_pct(cpu0, foreign_cpu_s(), wall)
        return RoundResult(wall, timings, machine)

    return await measure_targets(
        targets, opts.concurrency, opts.rounds, one, FIGURES, opts.warmup, opts.max_tokens
    )


# --- the run -------------------------------------------------------------------------------


def _start_targets(
    procs: Processes, pipeline: PipelineConfig, opts: BenchOptions, data_dir: Path, core: int
) -> dict[str, Target]:
    """The omnirelay stack (with its NATS) and the vLLM api_server; returns both once ready."""
    from libs.models.tiny import resolve_model
    from libs.stack.local_nats import free_port

    env = engine_env(pipeline, core)
    model, port = pipeline.served_model_name, free_port()
    api_argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    api_argv += ["--model", resolve_model(pipeline.thinker.model), "--served-model-name", model]
    api_argv += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    vllm = procs.start("vllm", api_argv + engine_flags(pipeline), env, stop_signal=signal.SIGINT)
    stack = start_stack(
        procs, GATEWAY, opts.pipeline_path, env, data_dir, sync_interval=opts.nats_sync_interval
    )
    log(f"vllm ready in {wait_healthy(vllm, port, 600):.1f} s")
    nats = tuple(stack.processes[name] for name in stack.monitors)
    return {
        GATEWAY: Target(GATEWAY, stack.api_url, model, stack.processes["up"], companions=nats),
        DIRECT: Target(DIRECT, f"http://127.0.0.1:{port}/v1", model, vllm),
    }


LATE_SHARE_LIMIT = 0.25
"""Above this share of burst-delivered requests (:func:`late_first_token_share`) TTFT is not trusted."""


def _timings(paired: Paired[RoundResult], target: str, workload: str | None = None) -> list[RequestTiming]:
    return [x for r in paired.results(target, workload) for x in r.timings]


def _verdict(paired: Paired[RoundResult], opts: BenchOptions) -> str:
    """The TTFT verdict at concurrency 1 (or the lowest measured), flagged when streams burst."""
    c0 = min(opts.concurrency)
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
        started = [p for t in targets.values() for p in (t.process, *t.companions)]
        if start.isolate_engines and (moved := isolate_engines(started, core)) is not None:
            log(
                f"{moved[0]} vLLM engine processes bound to core {core}; {moved[1]} others to the other cores"
            )
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
