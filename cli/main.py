"""The ``omnirelay`` command line: one entry point, one subcommand per service and tool.

Options default to the environment (``OMNIRELAY_*``, ``NATS_URL``) through the services'
pydantic settings; a flag given on the command line wins.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from cli.bench_commands import bench_app
from cli.nats_commands import nats_app
from cli.params import SyncInterval, usage_error
from cli.stack_file import DEFAULT_DATA_DIR
from cli.verify_commands import verify_app
from libs.common.logs import set_service_identity
from libs.common.pipeline import PipelineConfigError, load_pipeline
from libs.common.runtime import run_service, yield_on_wakeup
from libs.common.settings import GatewaySettings, OrchestratorSettings, ServiceSettings, WorkerSettings
from libs.stack.local_nats import SYNC_INTERVAL

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
MetricsPortOpt = Annotated[
    int | None, typer.Option(help="/metrics port, 0 = any [env OMNIRELAY_METRICS_PORT]")
]
LogLevelOpt = Annotated[
    str | None, typer.Option("--log-level", help="logging level [env OMNIRELAY_LOG_LEVEL; default INFO]")
]


RateOpt = float | None
JourneyRateOpt = Annotated[
    RateOpt,
    typer.Option(
        help="share of requests traced inside the engine, 0..1 [env OMNIRELAY_JOURNEY_TRACING_SAMPLE_RATE; default 1.0]"
    ),
]
StepTracingOpt = Annotated[
    bool | None,
    typer.Option(
        "--step-tracing-enabled/--no-step-tracing-enabled",
        help="scheduler step tracing [env OMNIRELAY_STEP_TRACING_ENABLED; default off]",
    ),
]
StepRateOpt = Annotated[
    RateOpt,
    typer.Option(
        help="share of steps with a batch summary, 0..1 [env OMNIRELAY_STEP_TRACING_SAMPLE_RATE; default 0.01]"
    ),
]
RichRateOpt = Annotated[
    RateOpt,
    typer.Option(
        help="share of summarized steps with per-request snapshots, 0..1 [env OMNIRELAY_STEP_TRACING_RICH_SUBSAMPLE_RATE; default 0.001]"
    ),
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
        usage_error(str(e))


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


@app.command()
def gateway(
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    host: Annotated[str | None, typer.Option(help="bind address [env OMNIRELAY_HOST]")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [env OMNIRELAY_PORT; default 8000]")] = None,
    admin_port: Annotated[
        int | None,
        typer.Option(
            help="/metrics and /prometheus/targets port, 0 = any [env OMNIRELAY_ADMIN_PORT; default 8001]"
        ),
    ] = None,
    log_stats: LogStatsOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Run the OpenAI-compatible HTTP gateway."""
    from services.gateway.app import run_gateway
    from services.gateway.auth import AuthConfigError

    s = _settings(
        GatewaySettings,
        pipeline=pipeline,
        nats_url=_service_nats_url(nats_url),
        host=host,
        port=port,
        admin_port=admin_port,
        log_stats=log_stats,
        log_level=log_level,
    )
    set_service_identity(s.log_level, "gateway")
    yield_on_wakeup(s.sched_batch)
    try:
        run_gateway(s, _pipeline(s))
    except AuthConfigError as e:
        usage_error(str(e))


@app.command()
def orchestrator(
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    metrics_port: MetricsPortOpt = None,
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
    set_service_identity(s.log_level, "orchestrator")
    yield_on_wakeup(s.sched_batch)
    run_service(run_orchestrator(s, _pipeline(s)))


@app.command()
def worker(
    stage: Annotated[int | None, typer.Option(help="stage id [env OMNIRELAY_STAGE]")] = None,
    replica: Annotated[int | None, typer.Option(help="replica id [env OMNIRELAY_REPLICA]")] = None,
    pipeline: PipelineOpt = None,
    nats_url: NatsOpt = None,
    metrics_port: MetricsPortOpt = None,
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
    journey_tracing_sample_rate: JourneyRateOpt = None,
    step_tracing_enabled: StepTracingOpt = None,
    step_tracing_sample_rate: StepRateOpt = None,
    step_tracing_rich_subsample_rate: RichRateOpt = None,
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
    set_service_identity(s.log_level, f"{name}-{s.replica}")
    run_service(run_worker(s, p))


@app.command()
def up(
    pipeline: PipelineOpt = None,
    port: Annotated[int, typer.Option(help="gateway HTTP port")] = 8000,
    admin_port: Annotated[
        int, typer.Option(help="gateway's /metrics and /prometheus/targets port (127.0.0.1), 0 = any free")
    ] = 8001,
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
    nats_sync_interval: SyncInterval = SYNC_INTERVAL,
) -> None:
    """Start NATS (unless --nats-url/NATS_URL), the orchestrator, every worker and the gateway."""
    from cli.launcher import NatsOptions, run_stack
    from cli.stack_file import NatsTarget, probe_nats, unreachable_message

    if nats_nodes not in (1, 3, 5):
        usage_error(f"--nats-nodes: 1, 3 or 5, not {nats_nodes}")
    if admin_port and admin_port == port:
        usage_error(f"--admin-port must differ from --port ({port})")
    if nats_url and nats_nodes != 1:
        usage_error("--nats-nodes starts servers; --nats-url / NATS_URL names servers to use")
    s = _settings(ServiceSettings, pipeline=pipeline, nats_url=nats_url)
    p = _pipeline(s)
    if nats_url and (error := asyncio.run(probe_nats(nats_url))):
        target = NatsTarget(nats_url, "--nats-url / NATS_URL")
        hint = "start that server first, or leave --nats-url / NATS_URL out and `up` starts its own"
        typer.echo(unreachable_message(target, error, hint), err=True)
        raise typer.Exit(1)
    nats = NatsOptions(nats_nodes, nats_sync_interval)
    stack = run_stack(
        p, s.pipeline.resolve(), port, log_stats, data_dir.resolve(), nats_url, nats, admin_port
    )
    raise typer.Exit(asyncio.run(stack))


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
    is given), else nats://127.0.0.1:4222; exits 2 within seconds, saying why, when NATS cannot
    be reached."""
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


@app.command("compose-check")
def compose_check(
    cold: Annotated[
        bool, typer.Option("--cold", help="build the image without the build cache (times a cold build)")
    ] = False,
    keep: Annotated[bool, typer.Option("--keep", help="leave the check's stack running at the end")] = False,
) -> None:
    """Build the images and run compose/docker-compose.yml in real containers on this host's Docker
    engine (started here if needed), check it end to end, and print a table (docs/compose.md,
    "What `make compose-check` proves"). Says so and exits 0 where no Docker engine can run."""
    from cli.compose_check.run import main as run_check

    repo = Path(__file__).resolve().parents[1]
    if not (repo / "compose" / "Dockerfile").is_file():
        usage_error(f"no compose/Dockerfile under {repo}: run this from an omnirelay checkout")
    raise typer.Exit(run_check(repo, cold, keep))


app.registered_commands += nats_app.registered_commands  # nats-secrets: cli/nats_commands.py
app.add_typer(bench_app, name="bench")  # cli/bench_commands.py
app.add_typer(verify_app, name="verify")  # cli/verify_commands.py


def main() -> None:
    app()
