"""``omnirelay bench <name>``: benchmarks that start their own stacks and print a table
(docs/benchmarks.md). Registered on the main command line by :mod:`cli.main`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from cli.params import sync_interval
from libs.common.pipeline import PipelineConfigError, load_pipeline
from libs.stack.local_nats import SYNC_INTERVAL

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: each starts its own stacks, measures, and prints a table (docs/benchmarks.md).",
)


def _levels(option: str, value: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``--concurrency 1,16``), or exit 2 naming
    ``option``."""
    from benchmarks.comparison_stats import parse_concurrency

    try:
        return tuple(parse_concurrency(value))
    except ValueError as e:
        typer.echo(f"error: {option}: {e}", err=True)
        raise typer.Exit(2) from None


def _pipeline_file(path: Path) -> Path:
    """``path`` resolved, once it loads as a pipeline file; else exit 2 with the reason."""
    try:
        load_pipeline(path)
    except PipelineConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    return path.resolve()


def _core(core: int | None) -> int | None:
    """``--core``, once this process may use it; else exit 2."""
    usable = sorted(os.sched_getaffinity(0))
    if core is not None and core not in usable:
        typer.echo(f"error: --core {core}: this process may use cores {usable}", err=True)
        raise typer.Exit(2)
    return core


@bench_app.command("gateway")
def bench(
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline", help="thinker-only pipeline YAML [default: compose/pipelines/text-only.yaml]"
        ),
    ] = None,
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,16",
    requests: Annotated[
        int | None,
        typer.Option(
            help="requests per (target, concurrency) over all rounds [default: 240 at c=1, 128 at c=16]"
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request (ignore_eos)")] = 64,
    warmup: Annotated[int, typer.Option(help="unmeasured requests per target first")] = 16,
    rounds: Annotated[int, typer.Option(help="alternating rounds per concurrency (A B, B A, ...)")] = 8,
    core: Annotated[
        int | None, typer.Option(help="CPU core both engines bind to [default: the first usable one]")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the raw numbers here")] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="keep the processes' logs here [default: a temp dir, removed]")
    ] = None,
    pause_idle: Annotated[
        bool,
        typer.Option(
            "--pause-idle/--no-pause-idle", help="SIGSTOP the target not being measured (idle vLLM polls)"
        ),
    ] = True,
    isolate_engines: Annotated[
        bool,
        typer.Option(
            "--isolate-engines/--no-isolate-engines",
            help="vLLM engine processes on --core, every other process (and this client) on the other cores",
        ),
    ] = True,
    nats_sync_interval: Annotated[
        str,
        typer.Option(
            help="JetStream sync_interval of the stack's NATS server ('always', 1s, 2m, ...)",
            callback=sync_interval,
        ),
    ] = SYNC_INTERVAL,
) -> None:
    """Benchmark the gateway against vLLM's own OpenAI server on the same thinker (prints a table)."""

    from benchmarks.gateway_vs_vllm import DEFAULT_PIPELINE, BenchOptions, run_bench

    levels = _levels("--concurrency", concurrency)
    if min(max_tokens, rounds) < 1 or (requests is not None and requests < 1) or warmup < 0:
        typer.echo("error: --max-tokens, --requests and --rounds must be ≥ 1, --warmup ≥ 0", err=True)
        raise typer.Exit(2)
    core = _core(core)
    path = _pipeline_file(pipeline or DEFAULT_PIPELINE)
    opts = BenchOptions(
        pipeline_path=path,
        concurrency=levels,
        requests=requests,
        max_tokens=max_tokens,
        warmup=warmup,
        rounds=rounds,
        core=core,
        json_path=json_path,
        log_dir=log_dir.resolve() if log_dir else None,
        pause_idle=pause_idle,
        isolate_engines=isolate_engines,
        nats_sync_interval=nats_sync_interval,
    )
    raise typer.Exit(run_bench(opts))


@bench_app.command("log-stats")
def bench_log_stats(
    rounds: Annotated[int, typer.Option(help="alternating rounds (A B, B A, ...)")] = 10,
    per_round: Annotated[int, typer.Option(help="sequential requests per side and round")] = 25,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request (ignore_eos)")] = 64,
) -> None:
    """What --log-stats costs: the same workload on two stacks, with and without it (prints a table)."""
    from benchmarks.log_stats_cost import run_log_stats_bench

    raise typer.Exit(run_log_stats_bench(rounds, per_round, max_tokens))


@bench_app.command("sync")
def bench_sync(
    rounds: Annotated[int, typer.Option(min=2, help="alternating rounds (A B C D, D C B A, ...)")] = 8,
    per_round: Annotated[int, typer.Option(min=2, help="sequential requests per setup and round")] = 20,
    max_tokens: Annotated[int, typer.Option(min=1, help="output tokens per request (ignore_eos)")] = 64,
    publishes: Annotated[int, typer.Option(min=10, help="sequential JetStream publishes per setup")] = 2000,
) -> None:
    """What JetStream's sync_interval and a 3-node NATS cluster cost: publish latency and end-to-end
    latency on one server with 2m (nats-server's default), 1s and always, and on 3 nodes with
    always (prints two tables)."""
    from benchmarks.sync_interval_cost import run_sync_bench

    raise typer.Exit(run_sync_bench(rounds, per_round, max_tokens, publishes))


@bench_app.command("ab")
def bench_ab(
    tree_a: Annotated[Path, typer.Argument(help="omnirelay checkout A (e.g. a `git worktree` of main)")],
    tree_b: Annotated[Path, typer.Argument(help="omnirelay checkout B (e.g. this one, with a change)")],
    blocks: Annotated[
        int, typer.Option(min=10, help="block pairs (A B, B A, ...); fewer give no useful interval")
    ] = 40,
    block: Annotated[int, typer.Option(help="sequential requests per block")] = 10,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request (ignore_eos)")] = 64,
) -> None:
    """Is B faster than A? Paired TTFT / e2e of two code trees on the same machine (prints a table)."""
    from benchmarks.paired_ab import run_ab_bench

    raise typer.Exit(run_ab_bench(tree_a, tree_b, blocks, block, max_tokens))


@bench_app.command("bus")
def bench_bus(
    messages: Annotated[int, typer.Option(help="measured messages per hop kind and placement")] = 400,
    interval_ms: Annotated[float, typer.Option(help="pause before each message, ms")] = 10.0,
    warmup: Annotated[int, typer.Option(help="unmeasured messages first")] = 50,
) -> None:
    """The floor of one bus hop between two processes (JetStream stage hop, core-NATS event hop),
    on any core and with everything on one core (prints a table)."""
    from benchmarks.bus_hop import render, run_bus_bench

    typer.echo(render(run_bus_bench(messages, interval_ms / 1e3, warmup)))


@bench_app.command("nice")
def bench_nice(
    rounds: Annotated[int, typer.Option(min=1, help="pairs of blocks (one at each nice value)")] = 3,
    nice: Annotated[int, typer.Option(min=1, max=19, help="the engines' nice value compared with 0")] = 10,
    block_s: Annotated[float, typer.Option("--block-s", min=10, help="seconds of load per block")] = 45.0,
) -> None:
    """What the engines' nice value gives the control plane under load and costs the engines:
    alternating blocks of the same load at nice 0 and ``--nice`` on one stack (see
    docs/reliability.md)."""
    from benchmarks.engine_priority import run_nice_bench

    raise typer.Exit(run_nice_bench(rounds, nice, block_s))


@bench_app.command("speech")
def bench_speech(
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline", help="speech pipeline YAML [default: compose/pipelines/orpheus-tiny.yaml]"
        ),
    ] = None,
    api: Annotated[
        str, typer.Option(help="chat: streamed chat completions with audio; speech: /v1/audio/speech")
    ] = "chat",
    formats: Annotated[
        str | None,
        typer.Option(
            help="comma-separated response_format values, each run at every level (--api speech only)",
            show_default="pcm,mp3",
        ),
    ] = None,
    levels: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,4,16",
    requests: Annotated[
        int,
        typer.Option(
            min=1, help="requests per concurrency level and format (64: about 4 minutes in all on 2 cores)"
        ),
    ] = 64,
    max_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="thinker tokens per chat request (ignore_eos)", show_default="32"),
    ] = None,
    voice: Annotated[str, typer.Option(help="the voice of every request")] = "tara",
    warmup: Annotated[
        int, typer.Option(min=0, help="unmeasured sequential requests first (per format with --api speech)")
    ] = 2,
    keep_logs: Annotated[
        bool, typer.Option(help="keep the stack's logs (their directory is printed)")
    ] = False,
) -> None:
    """Speech latency: time to first audio and RTF p50/p99 at each concurrency level through the
    official openai client, of streamed pcm16 chat completions with audio (--api chat) or of
    /v1/audio/speech in each of --formats (--api speech); prints a table (see docs/models.md)."""
    from benchmarks.speech_latency import (
        APIS,
        DEFAULT_PIPELINE,
        DEFAULT_SPEECH_FORMATS,
        parse_formats,
        run_speech_bench,
    )

    def usage_error(message: str) -> typer.Exit:
        typer.echo(f"error: {message}", err=True)
        return typer.Exit(2)

    if api not in APIS:
        raise usage_error(f"--api {api}: one of {', '.join(APIS)}")
    if api == "chat" and formats is not None:
        raise usage_error("--formats applies to --api speech only")
    if api == "speech" and max_tokens is not None:
        raise usage_error("--max-tokens applies to --api chat only (speech audio follows its input)")
    try:
        chosen = (
            parse_formats(formats if formats is not None else ",".join(DEFAULT_SPEECH_FORMATS))
            if api == "speech"
            else ()
        )
    except ValueError as e:
        raise usage_error(f"--formats: {e}") from None
    parsed = _levels("--levels", levels)
    path = (pipeline or DEFAULT_PIPELINE).resolve()
    try:
        p = load_pipeline(path)
    except PipelineConfigError as e:
        raise usage_error(str(e)) from None
    if p.audio_stage is None:
        raise usage_error(f"--pipeline {path}: pipeline '{p.name}' produces no audio")
    raise typer.Exit(
        run_speech_bench(path, parsed, requests, max_tokens or 32, voice, warmup, keep_logs, chosen)
    )


@bench_app.command("realtime")
def bench_realtime(
    pipeline: Annotated[
        Path | None,
        typer.Option("--pipeline", help="a pipeline with a listener [default: the shipped one]"),
    ] = None,
    sessions: Annotated[str, typer.Option(help="comma-separated numbers of concurrent sessions")] = "1,4,16",
    turns: Annotated[int, typer.Option(min=1, help="spoken turns per session")] = 3,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="thinker tokens per answer (max_output_tokens)")
    ] = 24,
    keep_logs: Annotated[
        bool, typer.Option(help="keep the stack's logs (their directory is printed)")
    ] = False,
) -> None:
    """Realtime voice-to-voice latency p50/p99 and the listener's RTF at each number of concurrent
    sessions, real speech sent in real time through the official openai client; prints a table
    (see docs/benchmarks.md)."""
    from benchmarks.realtime_latency import DEFAULT_PIPELINE, run_realtime_bench

    path = (pipeline or DEFAULT_PIPELINE).resolve()
    try:
        p = load_pipeline(path)
    except PipelineConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if p.listener_stage is None or p.audio_stage is None:
        typer.echo(f"error: --pipeline {path}: pipeline '{p.name}' needs a listener and audio out", err=True)
        raise typer.Exit(2)
    raise typer.Exit(run_realtime_bench(path, _levels("--sessions", sessions), turns, max_tokens, keep_logs))


@bench_app.command("codec-batching")
def bench_codec_batching(
    batches: Annotated[str, typer.Option(help="chunks per forward pass, comma-separated")] = "1,4,16",
    own_frames: Annotated[str, typer.Option(help="own frames per chunk, comma-separated")] = "2,8",
    rounds: Annotated[int, typer.Option(min=1, help="paired rounds per cell")] = 7,
    real_size: Annotated[
        bool, typer.Option("--real-size", help="also a SNAC with snac_24khz's widths (random weights)")
    ] = False,
) -> None:
    """code2wav's SNAC decode with and without cross-request batching: paired rounds of one forward
    pass per chunk against one pass for all (prints a table; see docs/models.md)."""
    from benchmarks.codec_batching import main as run_codec_batching

    argv = ["--batches", batches, "--own-frames", own_frames, "--rounds", str(rounds)]
    raise typer.Exit(run_codec_batching(argv + (["--real-size"] if real_size else [])))


@bench_app.command("capacity")
def bench_capacity(
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline", help="pipeline on the mock engine [default: compose/pipelines/mock-text.yaml]"
        ),
    ] = None,
    gateways: Annotated[str, typer.Option(help="comma-separated gateway counts (1 or 2)")] = "1,2",
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "64,256",
    requests: Annotated[
        int | None, typer.Option(min=1, help="requests per cell", show_default="5 × the concurrency")
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="output tokens per request")] = 64,
    clients: Annotated[
        int, typer.Option(min=1, max=16, help="client processes sharing the load (each a closed loop)")
    ] = 2,
    warmup: Annotated[int, typer.Option(min=1, help="unmeasured requests through each gateway first")] = 64,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the raw numbers here")] = None,
    keep_logs: Annotated[
        bool, typer.Option(help="keep the stack's logs (their directory is printed)")
    ] = False,
) -> None:
    """omnirelay's own ceiling on the mock engine: req/s, output tokens/s, TTFT/TPOT p50/p99 and
    each process's CPU per (gateways, concurrency), with the bottleneck named (prints tables)."""
    from benchmarks.frontend_capacity import MOCK_PIPELINE, CapacityOptions, run_capacity_bench

    gws, levels = _levels("--gateways", gateways), _levels("--concurrency", concurrency)
    if max(gws) > 2:
        typer.echo("error: --gateways: 1 and 2 are measured (omnirelay up's gateway and one more)", err=True)
        raise typer.Exit(2)
    path = _pipeline_file(pipeline or MOCK_PIPELINE)
    opts = CapacityOptions(
        pipeline_path=path,
        gateways=gws,
        concurrency=levels,
        requests=requests,
        max_tokens=max_tokens,
        clients=clients,
        warmup=warmup,
        json_path=json_path,
        keep_logs=keep_logs,
    )
    raise typer.Exit(run_capacity_bench(opts))


@bench_app.command("vllm")
def bench_vllm(
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline", help="thinker-only pipeline YAML [default: compose/pipelines/text-only.yaml]"
        ),
    ] = None,
    concurrency: Annotated[str, typer.Option(help="comma-separated --max-concurrency levels")] = "1,16",
    rounds: Annotated[int, typer.Option(min=1, help="paired rounds (A B, B A, ...)")] = 5,
    prompts: Annotated[
        int | None,
        typer.Option(min=1, help="--num-prompts per run", show_default="48 at c=1, else 16 × c"),
    ] = None,
    input_len: Annotated[int, typer.Option(min=1, help="--random-input-len")] = 48,
    output_len: Annotated[int, typer.Option(min=2, help="--random-output-len (with --ignore-eos)")] = 64,
    isolate_engines: Annotated[
        bool,
        typer.Option(
            "--isolate-engines/--no-isolate-engines",
            help="engines on --core, everything else on the other cores; --no-isolate-engines: "
            "nothing pinned, as a user would start them (vLLM's own server then starves on 2 cores)",
        ),
    ] = True,
    core: Annotated[
        int | None, typer.Option(help="CPU core both engines bind to [default: the first usable one]")
    ] = None,
    nats_sync_interval: Annotated[
        str,
        typer.Option(
            help="JetStream sync_interval of omnirelay's NATS server ('always', 1s, 2m, ...)",
            callback=sync_interval,
        ),
    ] = SYNC_INTERVAL,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the raw numbers here")] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="keep the processes' logs and vLLM's result files here")
    ] = None,
) -> None:
    """omnirelay against vLLM's own server, measured by vLLM's own client (vllm bench serve) in
    paired rounds: median and spread of the per-round omnirelay ÷ vLLM ratios (prints tables)."""
    from benchmarks.gateway_vs_vllm import DEFAULT_PIPELINE
    from benchmarks.vllm_client_paired import VllmClientOptions, run_vllm_client_bench

    levels = _levels("--concurrency", concurrency)
    core = _core(core)
    path = _pipeline_file(pipeline or DEFAULT_PIPELINE)
    opts = VllmClientOptions(
        pipeline_path=path,
        concurrency=levels,
        rounds=rounds,
        prompts=prompts,
        input_len=input_len,
        output_len=output_len,
        isolate_engines=isolate_engines,
        core=core,
        nats_sync_interval=nats_sync_interval,
        json_path=json_path,
        log_dir=log_dir.resolve() if log_dir else None,
    )
    raise typer.Exit(run_vllm_client_bench(opts))


@bench_app.command("profile")
def bench_profile(
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,16",
    seconds: Annotated[float, typer.Option(min=1, help="load (and recording) per level, seconds")] = 20.0,
    max_tokens: Annotated[int, typer.Option(min=2, help="output tokens per request (ignore_eos)")] = 64,
    rate: Annotated[int, typer.Option(min=1, max=1000, help="py-spy samples per second")] = 200,
    gil: Annotated[
        bool,
        typer.Option(
            "--gil/--all-threads",
            help="sample only the thread holding the GIL (Python CPU); --all-threads: every thread py-spy sees as busy",
        ),
    ] = True,
    out_dir: Annotated[
        Path | None, typer.Option(help="keep the raw py-spy files and the tables (profile.md) here")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the folded numbers here")] = None,
) -> None:
    """Sample the gateway's and the worker's Python stacks with py-spy while streamed chat
    completions run on the mock engine; print where each output token's microseconds go (tables)."""
    from benchmarks.token_path_profile import ProfileOptions, run_profile_bench

    levels = _levels("--concurrency", concurrency)
    opts = ProfileOptions(
        concurrency=levels,
        seconds=seconds,
        max_tokens=max_tokens,
        rate=rate,
        gil=gil,
        out_dir=out_dir.resolve() if out_dir else None,
        json_path=json_path,
    )
    raise typer.Exit(run_profile_bench(opts))


@bench_app.command("token-cost")
def bench_token_cost(
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,16",
    rounds: Annotated[int, typer.Option(min=1, help="paired rounds (A B, B A, ...)")] = 5,
    requests: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="requests per side per round and level",
            show_default="96 at c=1, 256 at c=16, else max(96, 16 × c)",
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=2, help="output tokens per request (ignore_eos)")] = 64,
    warmup: Annotated[int, typer.Option(min=1, help="unmeasured requests per side first")] = 32,
    tree_a: Annotated[
        Path | None, typer.Option(help="checkout A (with --tree-b: stack against stack, not the reference)")
    ] = None,
    tree_b: Annotated[Path | None, typer.Option(help="checkout B")] = None,
    write_baseline: Annotated[
        bool, typer.Option("--write-baseline", help="record the ratios in --baseline (default mode only)")
    ] = False,
    check: Annotated[
        bool, typer.Option("--check", help="exit 1 when a ratio's median exceeds the baseline's × --factor")
    ] = False,
    baseline: Annotated[
        Path | None, typer.Option(help="baseline file", show_default="benchmarks/baselines/token_cost.json")
    ] = None,
    factor: Annotated[
        float | None,
        typer.Option(
            min=1.0, help="--check's bound on measured ÷ baseline", show_default="1.5, the CI guard's"
        ),
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write every round's samples here")] = None,
) -> None:
    """CPU µs per output token of the gateway and the worker and TPOT p50 on the mock engine, as
    paired ratios: omnirelay ÷ a bare uvicorn + Starlette SSE server, or tree B ÷ tree A (prints
    per-round ratios and their medians with the range)."""
    from benchmarks.token_cost import BASELINE_PATH, GUARD_FACTOR, TokenCostOptions, run_token_cost_bench

    levels = _levels("--concurrency", concurrency)
    if (tree_a is None) != (tree_b is None):
        typer.echo("error: --tree-a and --tree-b go together", err=True)
        raise typer.Exit(2)
    trees = [t.resolve() for t in (tree_a, tree_b) if t is not None]
    if any(not (t / "cli" / "__main__.py").is_file() for t in trees):
        typer.echo("error: --tree-a/--tree-b: not an omnirelay checkout", err=True)
        raise typer.Exit(2)
    if trees and (write_baseline or check):
        typer.echo(
            "error: the baseline is omnirelay ÷ the reference: no --write-baseline/--check with trees",
            err=True,
        )
        raise typer.Exit(2)
    defaults = TokenCostOptions()
    opts = TokenCostOptions(
        concurrency=levels,
        rounds=rounds,
        requests={c: requests for c in levels} if requests else defaults.requests,
        max_tokens=max_tokens,
        warmup=warmup,
        tree_a=trees[0] if trees else None,
        tree_b=trees[1] if trees else None,
        json_path=json_path,
    )
    path = baseline or BASELINE_PATH
    raise typer.Exit(
        run_token_cost_bench(
            opts, path if write_baseline else None, path if check else None, factor or GUARD_FACTOR
        )
    )
