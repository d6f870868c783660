"""Option callbacks shared by commands of the ``omnirelay`` command line."""

from __future__ import annotations

import typer

from libs.stack.local_nats import check_sync_interval


def sync_interval(value: str) -> str:
    """``--nats-sync-interval``: a value nats-server takes (else a usage error, exit 2)."""
    try:
        check_sync_interval(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value
