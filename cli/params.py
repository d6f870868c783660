"""Options shared by commands of the ``omnirelay`` command line."""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

from libs.stack.local_nats import check_sync_interval


def usage_error(message: str) -> NoReturn:
    """Say ``message`` as a usage error and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def sync_interval(value: str) -> str:
    """``--nats-sync-interval``: a value nats-server takes (else a usage error, exit 2)."""
    try:
        check_sync_interval(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


KeepLogs = Annotated[bool, typer.Option(help="keep the stacks' logs (their directory is printed)")]
SyncInterval = Annotated[
    str,
    typer.Option(
        help="JetStream sync_interval of the NATS servers started: 'always' (fsync every write) or a "
        "period such as 1s or 2m (nats-server's default; the writes of the last period die with the machine)",
        callback=sync_interval,
    ),
]
