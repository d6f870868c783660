"""``omnirelay bench <name>``: benchmarks that start their own stacks and print a table
(docs/benchmarks.md). Registered on the main command line by :mod:`cli.main`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from cli.params import KeepLogs, SyncInterval, usage_error
from libs.common.pipeline import PipelineConfig, PipelineConfigError, load_pipeline
from libs.stack.local_nats import SYNC_INTERVAL

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: each starts its own stacks, measures, and prints a table (docs/benchmarks.md).",
)


JsonPath = Annotated[Path | None, typer.Option("--json", help="write the raw numbers here (JSON)")]
EngineCore = Annotated[
    int | None, typer.Option(help="CPU core both engines bind to [default: the first usable one]")
]
ThinkerPipeline = Annotated[
    Path | None,
    typer.Option("--pipeline", help="thinker-only pipeline YAML [default: compose/pipelines/text-only.yaml]"),
]
IsolateEngines = Annotated[
    bool,
    typer.Option(
        "--isolate-engines/--no-isolate-engines",
        help="vLLM engine processes on --core, every other process (this client included) on the other "
        "cores; --no-isolate-engines: nothing pinned (vLLM's own server then starves on 2 cores)",
    ),
]
MaxTokens = Annotated[int, typer.Option(min=1, help="output tokens per request (ignore_eos)")]
Levels = Annotated[str, typer.Option(help="comma-separated concurrency levels")]
Rounds = Annotated[int, typer.Option(min=1, help="paired rounds (A B, B A, ...)")]
LogDir = Annotated[
    Path | None, typer.Option(help="keep the processes' logs here [default: a temp dir, removed]")
]


def _levels(option: str, value: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``--concurrency 1,16``), or exit 2 naming
    ``option``."""
    from benchmarks.comparison_stats import parse_concurrency

    try:
        return tuple(parse_concurrency(value))
    except ValueError as e:
        usage_error(f"{option}: {e}")


def _pipeline_file(path: Path, needs: Callable[[PipelineConfig], bool] | None = None, what: str = "") -> Path:
    """``path`` resolved, once it loads as a pipeline file for which ``needs`` holds; else exit 2
    with the reason (``what`` it lacks)."""
    try:
        pipeline = load_pipeline(path)
    except PipelineConfigError as e:
        usage_error(str(e))
    if needs is not None and not needs(pipeline):
        usage_error(f"--pipeline {path}: pipeline '{pipeline.name}' {what}")
    return path.resolve()


def _checkouts(*trees: Path | None) -> list[Path]:
    """The trees given, resolved, once each is an omnirelay checkout; else exit 2."""
    found = [t.resolve() for t in trees if t is not None]
    for tree in found:
        if not (tree / "cli" / "__main__.py").is_file():
            usage_error(f"{tree} is not an omnirelay checkout")
    return found


def _core(core: int | None) -> int | None:
    """``--core``, once this process may use it; else exit 2."""
    usable = sorted(os.sched_getaffinity(0))
    if core is not None and core not in usable:
        usage_error(f"--core {core}: this process may use cores {usable}")
    return core


@bench_app.command("gateway")
def bench(
    pipeline: ThinkerPipeline = None,
    concurrency: Levels = "1,16",
    requests: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="requests per (target, concurrency) over all rounds [default: 240 at c=1, 128 at c=16]",
        ),
    ] = None,
    max_tokens: MaxTokens = 64,
    warmup: Annotated[int, typer.Option(min=0, help="unmeasured requests per target first")] = 16,
    rounds: Rounds = 8,
    core: EngineCore = None,
    json_path: JsonPath = None,
    log_dir: LogDir = None,
    isolate_engines: IsolateEngines = True,
    nats_sync_interval: SyncInterval = SYNC_INTERVAL,
) -> None:
    """Benchmark the gateway against vLLM's own OpenAI server on the same thinker (prints a table)."""
    from benchmarks.gateway_vs_vllm import DEFAULT_PIPELINE, BenchOptions, run_bench

    opts = BenchOptions(
        pipeline_path=_pipeline_file(pipeline or DEFAULT_PIPELINE),
        concurrency=_levels("--concurrency", concurrency),
        requests=requests,
        max_tokens=max_tokens,
        warmup=warmup,
        rounds=rounds,
        core=_core(core),
        json_path=json_path,
        log_dir=log_dir.resolve() if log_dir else None,
        isolate_engines=isolate_engines,
        nats_sync_interval=nats_sync_interval,
    )
    raise typer.Exit(run_bench(opts))


@bench_app.command("log-stats")
def bench_log_stats(
    rounds: Rounds = 10,
    per_round: Annotated[int, typer.Option(min=1, help="sequential requests per side and round")] = 25,
    max_tokens: MaxTokens = 64,
    json_path: JsonPath = None,
) -> None:
    """What --log-stats costs: the same workload on two stacks, with and without it (prints a table)."""
    from benchmarks.log_stats_cost import run_log_stats_bench

    raise typer.Exit(run_log_stats_bench(rounds, per_round, max_tokens, json_path))


@bench_app.command("sync")
def bench_sync(
    rounds: Annotated[int, typer.Option(min=2, help="alternating rounds (A B C D, D C B A, ...)")] = 8,
    per_round: Annotated[int, typer.Option(min=2, help="sequential requests per setup and round")] = 20,
    max_tokens: MaxTokens = 64,
    publishes: Annotated[int, typer.Option(min=10, help="sequential JetStream publishes per setup")] = 2000,
    json_path: JsonPath = None,
) -> None:
    """What JetStream's sync_interval and a 3-node NATS cluster cost: publish and end-to-end latency
    on one server with 2m, 1s and always, and on 3 nodes with always (prints two tables)."""
    from benchmarks.sync_interval_cost import run_sync_bench

    raise typer.Exit(run_sync_bench(rounds, per_round, max_tokens, publishes, json_path))


@bench_app.command("ab")
def bench_ab(
    tree_a: Annotated[Path, typer.Argument(help="omnirelay checkout A (e.g. a `git worktree` of main)")],
    tree_b: Annotated[Path, typer.Argument(help="omnirelay checkout B (e.g. this one, with a change)")],
    blocks: Annotated[
        int, typer.Option(min=10, help="block pairs (A B, B A, ...); fewer give no useful interval")
    ] = 40,
    block: Annotated[int, typer.Option(min=1, help="sequential requests per block")] = 10,
    max_tokens: MaxTokens = 64,
    json_path: JsonPath = None,
) -> None:
    """Is B faster than A? Paired TTFT / e2e of two code trees on the same machine (prints a table)."""
    from benchmarks.paired_ab import run_ab_bench

    a, b = _checkouts(tree_a, tree_b)
    raise typer.Exit(run_ab_bench(a, b, blocks, block, max_tokens, json_path))


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
    json_path: JsonPath = None,
) -> None:
    """What the engines' nice value gives the control plane under load and costs the engines:
    alternating blocks of one load at nice 0 and --nice (see docs/reliability.md)."""
    from benchmarks.engine_priority import run_nice_bench

    raise typer.Exit(run_nice_bench(rounds, nice, block_s, json_path))


def _speech_formats(api: str, formats: str | None, max_tokens: int | None) -> tuple[str, ...]:
    """``bench speech``'s formats (none with ``--api chat``), once ``--api``, ``--formats`` and
    ``--max-tokens`` go together; else exit 2."""
    from benchmarks.speech_latency import APIS, DEFAULT_SPEECH_FORMATS, parse_formats

    if api not in APIS:
        usage_error(f"--api {api}: one of {', '.join(APIS)}")
    if api == "chat":
        if formats is not None:
            usage_error("--formats applies to --api speech only")
        return ()
    if max_tokens is not None:
        usage_error("--max-tokens applies to --api chat only (speech audio follows its input)")
    try:
        return parse_formats(formats or ",".join(DEFAULT_SPEECH_FORMATS))
    except ValueError as e:
        usage_error(f"--formats: {e}")


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
    levels: Levels = "1,4,16",
    requests: Annotated[int, typer.Option(min=1, help="requests per concurrency level and format")] = 64,
    max_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="thinker tokens per chat request (ignore_eos)", show_default="32"),
    ] = None,
    voice: Annotated[str, typer.Option(help="the voice of every request")] = "tara",
    warmup: Annotated[
        int, typer.Option(min=0, help="unmeasured sequential requests first (per format with --api speech)")
    ] = 2,
    keep_logs: KeepLogs = False,
) -> None:
    """Speech latency: time to first audio and RTF p50/p99 per concurrency level, of streamed pcm16
    chat completions (--api chat) or of /v1/audio/speech in each of --formats (--api speech)."""
    from benchmarks.speech_latency import DEFAULT_PIPELINE, run_speech_bench

    chosen = _speech_formats(api, formats, max_tokens)
    parsed = _levels("--levels", levels)
    path = _pipeline_file(
        pipeline or DEFAULT_PIPELINE, lambda p: p.audio_stage is not None, "produces no audio"
    )
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
    keep_logs: KeepLogs = False,
) -> None:
    """Realtime voice-to-voice latency p50/p99 and the listener's RTF per number of concurrent
    sessions, real speech sent in real time (prints a table)."""
    from benchmarks.realtime_latency import DEFAULT_PIPELINE, run_realtime_bench

    path = _pipeline_file(
        pipeline or DEFAULT_PIPELINE,
        lambda p: p.listener_stage is not None and p.audio_stage is not None,
        "needs a listener and audio out",
    )
    raise typer.Exit(run_realtime_bench(path, _levels("--sessions", sessions), turns, max_tokens, keep_logs))


@bench_app.command("codec-batching")
def bench_codec_batching(
    batches: Annotated[str, typer.Option(help="chunks per forward pass, comma-separated")] = "1,4,16",
    own_frames: Annotated[str, typer.Option(help="own frames per chunk, comma-separated")] = "2,8",
    rounds: Annotated[int, typer.Option(min=1, help="paired rounds per cell")] = 7,
    real_size: Annotated[
        bool, typer.Option("--real-size", help="also a SNAC with snac_24khz's widths (random weights)")
    ] = False,
    json_path: JsonPath = None,
) -> None:
    """code2wav's SNAC decode with and without cross-request batching: one forward pass per chunk
    against one for all, in paired rounds (prints a table)."""
    from benchmarks.codec_batching import run_codec_batching

    sizes, own = _levels("--batches", batches), _levels("--own-frames", own_frames)
    raise typer.Exit(run_codec_batching(sizes, own, rounds, real_size, json_path))


@bench_app.command("audio-encoding")
def bench_audio_encoding(
    seconds: Annotated[float, typer.Option(min=1, help="audio seconds per run")] = 30.0,
    rounds: Annotated[int, typer.Option(min=1, help="runs per format, formats interleaved")] = 5,
    core: Annotated[
        int | None, typer.Option(help="the core to pin to [default: the last usable one]")
    ] = None,
) -> None:
    """What the gateway's audio encoding costs per format: real-time factor, longest push and bit
    rate of each encoder and of the tempo filter, on one core (prints a table)."""
    from benchmarks.audio_encoding import run_audio_encoding

    raise typer.Exit(run_audio_encoding(seconds, rounds, _core(core)))


@bench_app.command("tracing")
def bench_tracing(
    which: Annotated[
        str, typer.Argument(help="scheduler: the scheduler loop without a model; engine: real engines; all")
    ] = "all",
) -> None:
    """What engine tracing costs (docs/engine-tracing.md): the scheduler's µs per step in each
    tracing configuration and real engines' latency with tracing off and on, in paired rounds."""
    from benchmarks.engine_tracing_cost import BENCHES

    if which not in (*BENCHES, "all"):
        usage_error(f"{which}: one of {', '.join(BENCHES)}, all")
    for name, run in BENCHES.items():
        if which in (name, "all"):
            run()


@bench_app.command("capacity")
def bench_capacity(
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline", help="pipeline on the mock engine [default: compose/pipelines/mock-text.yaml]"
        ),
    ] = None,
    gateways: Annotated[str, typer.Option(help="comma-separated gateway counts (1 or 2)")] = "1,2",
    concurrency: Levels = "64,256",
    requests: Annotated[
        int | None, typer.Option(min=1, help="requests per cell", show_default="5 × the concurrency")
    ] = None,
    max_tokens: MaxTokens = 64,
    clients: Annotated[
        int, typer.Option(min=1, max=16, help="client processes sharing the load (each a closed loop)")
    ] = 2,
    warmup: Annotated[int, typer.Option(min=1, help="unmeasured requests through each gateway first")] = 64,
    json_path: JsonPath = None,
    keep_logs: KeepLogs = False,
) -> None:
    """omnirelay's own ceiling on the mock engine: req/s, output tokens/s, TTFT/TPOT p50/p99 and
    each process's CPU per (gateways, concurrency), with the bottleneck named (prints tables)."""
    from benchmarks.frontend_capacity import MOCK_PIPELINE, CapacityOptions, run_capacity_bench

    gws, levels = _levels("--gateways", gateways), _levels("--concurrency", concurrency)
    if max(gws) > 2:
        usage_error("--gateways: 1 and 2 are measured (omnirelay up's gateway and one more)")
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
    pipeline: ThinkerPipeline = None,
    concurrency: Annotated[str, typer.Option(help="comma-separated --max-concurrency levels")] = "1,16",
    rounds: Rounds = 5,
    prompts: Annotated[
        int | None,
        typer.Option(min=1, help="--num-prompts per run", show_default="48 at c=1, else 16 × c"),
    ] = None,
    input_len: Annotated[int, typer.Option(min=1, help="--random-input-len")] = 48,
    output_len: Annotated[int, typer.Option(min=2, help="--random-output-len (with --ignore-eos)")] = 64,
    isolate_engines: IsolateEngines = True,
    core: EngineCore = None,
    nats_sync_interval: SyncInterval = SYNC_INTERVAL,
    json_path: JsonPath = None,
    log_dir: LogDir = None,
) -> None:
    """omnirelay against vLLM's own server, measured by vLLM's own client (vllm bench serve) in
    paired rounds: median and spread of the per-round omnirelay ÷ vLLM ratios (prints tables)."""
    from benchmarks.gateway_vs_vllm import DEFAULT_PIPELINE
    from benchmarks.vllm_client_paired import VllmClientOptions, run_vllm_client_bench

    opts = VllmClientOptions(
        pipeline_path=_pipeline_file(pipeline or DEFAULT_PIPELINE),
        concurrency=_levels("--concurrency", concurrency),
        rounds=rounds,
        prompts=prompts,
        input_len=input_len,
        output_len=output_len,
        isolate_engines=isolate_engines,
        core=_core(core),
        nats_sync_interval=nats_sync_interval,
        json_path=json_path,
        log_dir=log_dir.resolve() if log_dir else None,
    )
    raise typer.Exit(run_vllm_client_bench(opts))


@bench_app.command("profile")
def bench_profile(
    concurrency: Levels = "1,16",
    seconds: Annotated[float, typer.Option(min=1, help="load (and recording) per level, seconds")] = 20.0,
    max_tokens: Annotated[int, typer.Option(min=2, help="output tokens per request (ignore_eos)")] = 64,
    rate: Annotated[int, typer.Option(min=1, max=1000, help="py-spy samples per second")] = 200,
    gil: Annotated[
        bool,
        typer.Option(
            "--gil/--all-threads",
            help="sample only the thread holding the GIL; --all-threads: every thread py-spy sees as busy",
        ),
    ] = True,
    out_dir: Annotated[
        Path | None, typer.Option(help="keep the raw py-spy files and the tables (profile.txt) here")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the folded numbers here")] = None,
) -> None:
    """Sample the gateway's and the worker's Python stacks with py-spy while streamed chat
    completions run on the mock engine; print where each output token's microseconds go (tables)."""
    from benchmarks.token_path_profile import ProfileOptions, run_profile_bench

    opts = ProfileOptions(
        concurrency=_levels("--concurrency", concurrency),
        seconds=seconds,
        max_tokens=max_tokens,
        rate=rate,
        gil=gil,
        out_dir=out_dir.resolve() if out_dir else None,
        json_path=json_path,
    )
    raise typer.Exit(run_profile_bench(opts))


def _trees(tree_a: Path | None, tree_b: Path | None, baseline_mode: bool) -> list[Path]:
    """``bench token-cost``'s checkouts: both or neither, and not with ``--write-baseline`` or
    ``--check`` (the baseline is omnirelay ÷ the reference); else exit 2."""
    if (tree_a is None) != (tree_b is None):
        usage_error("--tree-a and --tree-b go together")
    trees = _checkouts(tree_a, tree_b)
    if trees and baseline_mode:
        usage_error("the baseline is omnirelay ÷ the reference: no --write-baseline/--check with trees")
    return trees


@bench_app.command("token-cost")
def bench_token_cost(
    concurrency: Levels = "1,16",
    rounds: Rounds = 5,
    requests: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="requests per side per round and level",
            show_default="48 at c=1, 128 at c=16, else max(48, 8 × c)",
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
    json_path: JsonPath = None,
) -> None:
    """CPU µs per output token of the gateway and the worker and TPOT p50 on the mock engine, as
    paired ratios: omnirelay ÷ a bare uvicorn + Starlette SSE server, or tree B ÷ tree A (prints
    per-round ratios and their medians with the range)."""
    from benchmarks.token_cost import BASELINE_PATH, GUARD_FACTOR, TokenCostOptions, run_token_cost_bench

    levels = _levels("--concurrency", concurrency)
    trees = _trees(tree_a, tree_b, write_baseline or check)
    opts = TokenCostOptions(
        concurrency=levels,
        rounds=rounds,
        requests={c: requests for c in levels} if requests else TokenCostOptions().requests,
        max_tokens=max_tokens,
        warmup=warmup,
        tree_a=trees[0] if trees else None,
        tree_b=trees[1] if trees else None,
        json_path=json_path,
    )
    path = baseline or BASELINE_PATH
    written, checked = (path if write_baseline else None), (path if check else None)
    raise typer.Exit(run_token_cost_bench(opts, written, checked, factor or GUARD_FACTOR))
