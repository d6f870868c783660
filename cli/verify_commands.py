"""``omnirelay verify <name>``: the fault suite and the chaos soak, which inject faults into a serving
stack and judge what its clients got against ground truth (docs/reliability.md). The suites are
verification, so they live with the tests (``tests/verification``) and run from a checkout.
Registered on the main command line by :mod:`cli.main`."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli.params import KeepLogs

verify_app = typer.Typer(
    no_args_is_help=True,
    help="Verification suites: faults injected into a serving stack, judged against ground truth "
    "(docs/reliability.md).",
)


def _checkout_tests() -> None:
    """Make this checkout's ``tests`` package importable (the installed package holds no tests);
    exit 2 when there is none."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "tests" / "verification").is_dir():
        typer.echo(f"error: no tests/verification in {root}: omnirelay verify runs from a checkout", err=True)
        raise typer.Exit(2)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


class FaultSuiteMode(StrEnum):
    """How ``verify faults`` runs the stack."""

    up = "up"
    services = "services"


class FaultSuitePipeline(StrEnum):
    """The pipeline ``verify faults`` runs (``tests/verification/fault_pipelines.py``)."""

    tiny = "tiny"
    orpheus = "orpheus"
    speech = "speech"


@verify_app.command("faults")
def verify_faults(
    only: Annotated[str | None, typer.Option(help="run only the faults whose name contains this")] = None,
    keep_logs: KeepLogs = False,
    mode: Annotated[
        FaultSuiteMode,
        typer.Option(
            help="how the stack runs: 'up' = `omnirelay up`; 'services' = one process per service "
            "under a restart policy like compose's `restart: unless-stopped` (Docker's back-off)"
        ),
    ] = FaultSuiteMode.up,
    pipeline: Annotated[
        FaultSuitePipeline,
        typer.Option(
            help="'tiny' = tiny thinker -> talker -> code2wav; 'orpheus' = orpheus-tiny.yaml's "
            "speaking stages; 'speech' = a Whisper listener before the tiny chain, serving realtime "
            "sessions (docs/reliability.md)"
        ),
    ] = FaultSuitePipeline.tiny,
) -> None:
    """The fault suite: a stack with two replicas of every stage serves streams while one fault at a
    time is injected and verified; prints a row per fault (see docs/reliability.md). Exits 1, its
    logs kept, when a row does not pass."""
    _checkout_tests()
    from tests.verification.fault_suite import run_fault_suite

    raise typer.Exit(run_fault_suite(only, keep_logs, mode.value, pipeline.value))


@verify_app.command("chaos")
def verify_chaos(
    minutes: Annotated[float, typer.Option(min=0.5, help="how long faults are injected, minutes")] = 10.0,
    seed: Annotated[int, typer.Option(help="seeds the draws of faults, victims, intervals and requests")] = 0,
    concurrency: Annotated[int, typer.Option(min=1, help="requests kept in flight")] = 6,
    all_replicas: Annotated[
        bool, typer.Option(help="also draw the fault that kills every thinker replica at once")
    ] = False,
    keep_logs: KeepLogs = False,
) -> None:
    """The chaos soak: the fault suite's stack serves a continuous mixed load (text and audio,
    streamed and not, 32–800 tokens) while a random fault, verified, strikes every 20–40 s; prints
    a row per fault and a total (see docs/reliability.md). Exits 1 when a request hung or lost or
    repeated tokens or audio, or an injection was not verified."""
    _checkout_tests()
    from tests.verification.chaos_soak import run_chaos_soak

    raise typer.Exit(run_chaos_soak(minutes, seed, concurrency, all_replicas, keep_logs))
