"""The ``omnirelay`` command line: one entry point, one subcommand per service and tool.

Options default to the environment (``OMNIRELAY_*``, ``NATS_URL``) through the services'
pydantic settings; a flag given on the command line wins.
"""

from __future__ import annotations

import asyncio
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from cli.stack_file import DEFAULT_DATA_DIR
from libs.common.local_nats import SYNC_INTERVAL, check_sync_interval
from libs.common.logs import setup_logging
from libs.common.pipeline import PipelineConfigError, load_pipeline
from libs.common.runtime import run_service, yield_on_wakeup
from libs.common.settings import GatewaySettings, OrchestratorSettings, ServiceSettings, WorkerSettings

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="omnirelay: multi-stage inference pipelines over NATS JetStream.",
)
models_app = typer.Typer(no_args_is_help=True, help="Model utilities.")
app.add_typer(models_app, name="models")

PipelineOpt = Annotated[
    Path | None,
    typer.Option("--pipeline", help="pipeline YAML [env OMNIRELAY_PIPELINE; default: the shipped one]"),
]
NatsOpt = Annotated[
    str | None,
    typer.Option(
        "--nats-url",
        help="NATS server [env NATS_URL; default: the `omnirelay up` running here "
        "(.omnirelay/stack.json), else nats://127.0.0.1:4222]",
    ),
]
LogStatsOpt = Annotated[
    bool | None,
    typer.Option(
        "--log-stats/--no-log-stats",
        help="record metrics and stats logs [env OMNIRELAY_LOG_STATS; default off]",
    ),
]
LogLevelOpt = Annotated[
    str | None, typer.Option("--log-level", help="logging level [env OMNIRELAY_LOG_LEVEL; default INFO]")
]


def _settings(cls: type[ServiceSettings], **overrides: Any) -> Any:
    """Settings from the environment with the given flags on top; a bad value exits with a
    message naming the flag (and its variable) and the reason."""
    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else "?"
            flag, var = f"--{field.replace('_', '-')}", f"OMNIRELAY_{field.upper()}"
            typer.echo(f"error: {flag} / {var}: {err['msg']} (got {err.get('input')!r})", err=True)
        raise typer.Exit(2) from None


def _pipeline(settings: ServiceSettings):
    try:
        return load_pipeline(settings.pipeline)
    except PipelineConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _service_nats_url(flag: str | None) -> str:
    """The NATS URL of a service (:func:`cli.stack_file.resolve_nats_url`). A service given its
    NATS (flag or variable: the launcher, compose, the tests) waits for it as long as it takes, as
    on a broker restart; one that found it by itself (the running ``up``'s file, or the default)
    exits 1 within seconds, saying so, when nothing answers there."""
    from cli.stack_file import EXPLICIT_SOURCES, probe_nats, resolve_nats_url, unreachable_message

    target = resolve_nats_url(flag)
    if target.source not in EXPLICIT_SOURCES and (error := asyncio.run(probe_nats(target.url))):
        typer.echo(unreachable_message(target, error), err=True)
        raise typer.Exit(1)
    return target.url


def _sync_interval(value: str) -> str:
    """``--nats-sync-interval``: a value nats-server takes (else a usage error, exit 2)."""
    try:
        check_sync_interval(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


@app.command()
def gateway(
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    host: Annotated[str | None, typer.Option(help="bind address [env OMNIRELAY_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [env OMNIRELAY_PORT; default 8000]")] = None,
    log_stats: LogStatsOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Run the OpenAI-compatible HTTP gateway."""
    from services.gateway.app import run_gateway

    s = _settings(
        GatewaySettings,
        pipeline=pipeline,
        nats_url=_service_nats_url(nats_url),
        host=host,
        port=port,
        log_stats=log_stats,
        log_level=log_level,
    )
    setup_logging(s.log_level, "gateway")
    yield_on_wakeup(s.sched_batch)
    run_gateway(s, _pipeline(s))


@app.command()
def orchestrator(
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="/metrics port, 0 = any [env OMNIRELAY_METRICS_PORT]")
    ] = None,
    log_stats: LogStatsOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Run an orchestrator instance (any number may run)."""
    from services.orchestrator.orchestrator import run_orchestrator

    s = _settings(
        OrchestratorSettings,
        pipeline=pipeline,
        nats_url=_service_nats_url(nats_url),
        metrics_port=metrics_port,
        log_stats=log_stats,
        log_level=log_level,
    )
    setup_logging(s.log_level, "orchestrator")
    yield_on_wakeup(s.sched_batch)
    run_service(run_orchestrator(s, _pipeline(s)))


@app.command()
def worker(
    stage: Annotated[int | None, typer.Option(help="stage id [env OMNIRELAY_STAGE]")] = None,
    replica: Annotated[int | None, typer.Option(help="replica id [env OMNIRELAY_REPLICA]")] = None,
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="/metrics port, 0 = any [env OMNIRELAY_METRICS_PORT]")
    ] = None,
    max_inflight: Annotated[
        int | None, typer.Option(help="requests handled at once [env OMNIRELAY_MAX_INFLIGHT]")
    ] = None,
    log_stats_interval_s: Annotated[
        float | None,
        typer.Option(
            "--log-stats-interval",
            help="seconds between vLLM stats log lines [env OMNIRELAY_LOG_STATS_INTERVAL_S; default 5]",
        ),
    ] = None,
    journey_tracing_sample_rate: Annotated[
        float | None,
        typer.Option(
            help="share of requests traced inside the engine, 0..1 [env OMNIRELAY_JOURNEY_TRACING_SAMPLE_RATE; default 1.0]"
        ),
    ] = None,
    step_tracing_enabled: Annotated[
        bool | None,
        typer.Option(
            "--step-tracing-enabled/--no-step-tracing-enabled",
            help="scheduler step tracing [env OMNIRELAY_STEP_TRACING_ENABLED; default off]",
        ),
    ] = None,
    step_tracing_sample_rate: Annotated[
        float | None,
        typer.Option(
            help="share of steps with a batch summary, 0..1 [env OMNIRELAY_STEP_TRACING_SAMPLE_RATE; default 0.01]"
        ),
    ] = None,
    step_tracing_rich_subsample_rate: Annotated[
        float | None,
        typer.Option(
            help="share of summarized steps with per-request snapshots, 0..1 [env OMNIRELAY_STEP_TRACING_RICH_SUBSAMPLE_RATE; default 0.001]"
        ),
    ] = None,
    log_stats: LogStatsOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Run the worker of one (stage, replica)."""
    from services.stage_worker.worker import run_worker

    s = _settings(
        WorkerSettings,
        stage=stage,
        replica=replica,
        pipeline=pipeline,
        nats_url=_service_nats_url(nats_url),
        metrics_port=metrics_port,
        max_inflight=max_inflight,
        log_stats_interval_s=log_stats_interval_s,
        journey_tracing_sample_rate=journey_tracing_sample_rate,
        step_tracing_enabled=step_tracing_enabled,
        step_tracing_sample_rate=step_tracing_sample_rate,
        step_tracing_rich_subsample_rate=step_tracing_rich_subsample_rate,
        log_stats=log_stats,
        log_level=log_level,
    )
    p = _pipeline(s)
    name = p.stages[s.stage].name if s.stage < len(p.stages) else "?"
    setup_logging(s.log_level, f"{name}-{s.replica}")
    run_service(run_worker(s, p))


@app.command()
def up(
    pipeline: PipelineOpt = None,
    port: Annotated[int, typer.Option(help="gateway HTTP port")] = 8000,
    log_stats: Annotated[
        bool, typer.Option("--log-stats/--no-log-stats", help="record metrics and stats logs")
    ] = False,
    data_dir: Annotated[
        Path,
        typer.Option(
            help="where the local NATS keeps JetStream data and stack.json tells the other commands "
            "where the stack is"
        ),
    ] = DEFAULT_DATA_DIR,
    nats_url: Annotated[
        str | None,
        typer.Option(
            "--nats-url",
            envvar="NATS_URL",
            help="use this NATS (every server of a cluster, comma-separated) instead of starting one",
        ),
    ] = None,
    nats_nodes: Annotated[
        int,
        typer.Option(
            help="NATS servers to start: 1, or 3 or 5 for a JetStream cluster whose streams and KV "
            "buckets keep a replica on every server (any one server may die)"
        ),
    ] = 1,
    nats_sync_interval: Annotated[
        str,
        typer.Option(
            help="JetStream sync_interval of the servers started: 'always' (fsync every write) or a "
            "period such as 1s or 2m (nats-server's default; the writes of the last period die with "
            "the machine)",
            callback=_sync_interval,
        ),
    ] = SYNC_INTERVAL,
) -> None:
    """Start NATS (unless --nats-url/NATS_URL), the orchestrator, every worker and the gateway."""
    from cli.launcher import NatsOptions, run_stack
    from cli.stack_file import NatsTarget, probe_nats, unreachable_message

    if nats_nodes not in (1, 3, 5):
        typer.echo(f"error: --nats-nodes: 1, 3 or 5, not {nats_nodes}", err=True)
        raise typer.Exit(2)
    if nats_url and nats_nodes != 1:
        typer.echo("error: --nats-nodes starts servers; --nats-url / NATS_URL names servers to use", err=True)
        raise typer.Exit(2)
    s = _settings(ServiceSettings, pipeline=pipeline, nats_url=nats_url)
    p = _pipeline(s)
    if nats_url and (error := asyncio.run(probe_nats(nats_url))):
        target = NatsTarget(nats_url, "--nats-url / NATS_URL")
        hint = "start that server first, or leave --nats-url / NATS_URL out and `up` starts its own"
        typer.echo(unreachable_message(target, error, hint), err=True)
        raise typer.Exit(1)
    nats = NatsOptions(nats_nodes, nats_sync_interval)
    raise typer.Exit(
        asyncio.run(run_stack(p, s.pipeline.resolve(), port, log_stats, data_dir.resolve(), nats_url, nats))
    )


@app.command("inspect")
def inspect_cmd(
    request_id: Annotated[str | None, typer.Argument(help="show this request's record")] = None,
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    data_dir: Annotated[
        Path,
        typer.Option(help="the data directory of the `omnirelay up` to find (its stack.json)"),
    ] = DEFAULT_DATA_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Streams, per-(stage, replica) consumer state, live services and in-flight requests.

    Talks to --nats-url / NATS_URL, else the `omnirelay up` running with --data-dir (its
    stack.json, also the source of the pipeline when neither --pipeline nor OMNIRELAY_PIPELINE
    is given), else
    nats://127.0.0.1:4222; exits 2 within seconds, saying why, when NATS cannot be reached."""
    from cli.bus_inspect import run_inspect
    from cli.stack_file import read_live_stack, resolve_nats_url

    target = resolve_nats_url(nats_url, data_dir)
    stack = read_live_stack(data_dir)
    if pipeline is None and "OMNIRELAY_PIPELINE" not in os.environ and stack and target.url == stack.nats_url:
        pipeline = Path(stack.pipeline_file)
    s = _settings(ServiceSettings, pipeline=pipeline, nats_url=target.url)
    raise typer.Exit(asyncio.run(run_inspect(target, _pipeline(s), request_id, as_json)))


@models_app.command("make-tiny")
def make_tiny_cmd(
    force: Annotated[bool, typer.Option(help="regenerate even if present")] = False,
    cache_dir: Annotated[
        Path | None, typer.Option(help="cache root [env OMNIRELAY_CACHE_DIR; default ~/.cache/omnirelay]")
    ] = None,
) -> None:
    """Generate the tiny thinker, talker and code2wav models (deterministic; no download)."""
    from libs.models.tiny import make_tiny

    for model_id, path in make_tiny(cache_dir, force=force).items():
        typer.echo(f"{model_id}\t{path}")


@app.command()
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
            callback=_sync_interval,
        ),
    ] = SYNC_INTERVAL,
) -> None:
    """Benchmark the gateway against vLLM's own OpenAI server on the same thinker (prints a table)."""

    from benchmarks.gateway_vs_vllm import DEFAULT_PIPELINE, BenchOptions, parse_concurrency, run_bench

    try:
        levels = tuple(parse_concurrency(concurrency))
    except ValueError as e:
        typer.echo(f"error: --concurrency: {e}", err=True)
        raise typer.Exit(2) from None
    if min(max_tokens, rounds) < 1 or (requests is not None and requests < 1) or warmup < 0:
        typer.echo("error: --max-tokens, --requests and --rounds must be ≥ 1, --warmup ≥ 0", err=True)
        raise typer.Exit(2)
    usable = sorted(os.sched_getaffinity(0))
    if core is not None and core not in usable:
        typer.echo(f"error: --core {core}: this process may use cores {usable}", err=True)
        raise typer.Exit(2)
    path = (pipeline or DEFAULT_PIPELINE).resolve()
    try:
        load_pipeline(path)
    except PipelineConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
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


@app.command("bench-log-stats")
def bench_log_stats(
    rounds: Annotated[int, typer.Option(help="alternating rounds (A B, B A, ...)")] = 10,
    per_round: Annotated[int, typer.Option(help="sequential requests per side and round")] = 25,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request (ignore_eos)")] = 64,
) -> None:
    """What --log-stats costs: the same workload on two stacks, with and without it (prints a table)."""
    from benchmarks.log_stats_cost import run_log_stats_bench

    raise typer.Exit(run_log_stats_bench(rounds, per_round, max_tokens))


@app.command("bench-sync")
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


@app.command("bench-ab")
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


@app.command("bench-bus")
def bench_bus(
    messages: Annotated[int, typer.Option(help="measured messages per hop kind and placement")] = 400,
    interval_ms: Annotated[float, typer.Option(help="pause before each message, ms")] = 10.0,
    warmup: Annotated[int, typer.Option(help="unmeasured messages first")] = 50,
) -> None:
    """The floor of one bus hop between two processes (JetStream stage hop, core-NATS event hop),
    on any core and with everything on one core (prints a table)."""
    from benchmarks.bus_hop import render, run_bus_bench

    typer.echo(render(run_bus_bench(messages, interval_ms / 1e3, warmup)))


class FaultSuiteMode(StrEnum):
    """How ``bench-faults`` runs the stack."""

    up = "up"
    services = "services"


@app.command("bench-faults")
def bench_faults(
    only: Annotated[str | None, typer.Option(help="run only the faults whose name contains this")] = None,
    keep_logs: Annotated[
        bool, typer.Option(help="keep the stacks' logs (their directory is printed)")
    ] = False,
    mode: Annotated[
        FaultSuiteMode,
        typer.Option(
            help="how the stack runs: 'up' = `omnirelay up` (its launcher restarts a process that "
            "exits); 'services' = as docker compose runs it, one process per service (NATS, the "
            "orchestrator, each worker, the gateway), each restarted after it exits with Docker's "
            "back-off (0.1 s doubling to 60 s), like `restart: unless-stopped`"
        ),
    ] = FaultSuiteMode.up,
) -> None:
    """The fault suite: a stack with two replicas of every stage serves streams while one fault at a
    time is injected and verified; prints a row per fault (see docs/reliability.md)."""
    from benchmarks.fault_suite import run_fault_suite

    raise typer.Exit(run_fault_suite(only, keep_logs, mode.value))


@app.command("bench-nice")
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


@app.command("bench-chaos")
def bench_chaos(
    minutes: Annotated[float, typer.Option(min=0.5, help="how long faults are injected, minutes")] = 10.0,
    seed: Annotated[int, typer.Option(help="seeds the draws of faults, victims, intervals and requests")] = 0,
    concurrency: Annotated[int, typer.Option(min=1, help="requests kept in flight")] = 6,
    all_replicas: Annotated[
        bool, typer.Option(help="also draw the fault that kills every thinker replica at once")
    ] = False,
    keep_logs: Annotated[
        bool, typer.Option(help="keep the stack's logs (their directory is printed)")
    ] = False,
) -> None:
    """The chaos soak: the fault suite's stack serves a continuous mixed load (text and audio,
    streamed and not, 32–800 tokens) while a random fault, verified, strikes every 20–40 s; prints
    a row per fault and a total (see docs/reliability.md). Exits 1 when a request hung or lost or
    repeated tokens or audio, or an injection was not verified."""
    from benchmarks.chaos_soak import run_chaos_soak

    raise typer.Exit(run_chaos_soak(minutes, seed, concurrency, all_replicas, keep_logs))


@app.command("bench-speech")
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
    from benchmarks.gateway_vs_vllm import parse_concurrency
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
    try:
        parsed = tuple(parse_concurrency(levels))
    except ValueError as e:
        raise usage_error(f"--levels: {e}") from None
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


@app.command("bench-codec-batching")
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


@app.command("compose-check")
def compose_check(
    cold: Annotated[
        bool, typer.Option("--cold", help="build the image without the build cache (times a cold build)")
    ] = False,
    keep: Annotated[bool, typer.Option("--keep", help="leave the check's stack running at the end")] = False,
) -> None:
    """Build the images and run compose/docker-compose.yml in real containers on this host's Docker
    engine (started here if needed), check it end to end, and print a table (compose/README.md,
    "What the check proves"). Says so and exits 0 where no Docker engine can run."""
    from cli.compose_check.run import main as run_check

    repo = Path(__file__).resolve().parents[1]
    if not (repo / "compose" / "Dockerfile").is_file():
        typer.echo(
            f"error: no compose/Dockerfile under {repo}: run this from an omnirelay checkout", err=True
        )
        raise typer.Exit(2)
    raise typer.Exit(run_check(repo, cold, keep))


def main() -> None:
    app()
