"""``omnirelay nats-secrets``: the NATS identities' secrets, the server's authorization and TLS
blocks, written into a directory (compose's one-shot ``nats-init`` service writes them into the
volumes the NATS server and each service mount). Registered on the main command line by
:mod:`cli.main`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from cli.params import usage_error
from libs.common.pipeline import PipelineConfigError, load_pipeline
from libs.stack.nats_security import prepare

nats_app = typer.Typer()
"""Holds the command until :mod:`cli.main` takes it over."""


@nats_app.command("nats-secrets")
def nats_secrets(
    out: Annotated[Path, typer.Option(help="directory to write into (created; what exists is kept)")],
    pipeline: Annotated[
        Path | None,
        typer.Option(help="pipeline YAML [env OMNIRELAY_PIPELINE; default: the default pipeline]"),
    ] = None,
    tls: Annotated[
        bool, typer.Option(help="generate a CA and the server's certificate; clients verify it")
    ] = True,
    mutual_tls: Annotated[
        bool, typer.Option(help="also a client certificate per identity, required by the server")
    ] = False,
    host: Annotated[
        list[str] | None,
        typer.Option(help="a name or IP address the server certificate is valid for (repeat)"),
    ] = None,
    owner: Annotated[
        str | None,
        typer.Option(help="UID:GID to give every file and directory written (compose: the services' user)"),
    ] = None,
    server_root: Annotated[
        Path | None,
        typer.Option(help="where the NATS server sees --out (paths in its TLS block) [default: --out]"),
    ] = None,
) -> None:
    """Write every identity's password (kept when it exists), the server's auth.conf and
    cluster-tls.conf, and with --tls the CA and certificates; nothing secret is printed."""
    try:
        p = load_pipeline(pipeline or os.environ.get("OMNIRELAY_PIPELINE") or None)
    except PipelineConfigError as e:
        usage_error(str(e))
    sec = prepare(out, p, tls=tls, mutual_tls=mutual_tls, hosts=host or None, server_root=server_root)
    if owner is not None:
        uid, gid = (int(x) for x in owner.split(":"))
        for path in [out, *out.rglob("*")]:
            os.chown(path, uid, gid)
    names = sorted(d.name for d in out.iterdir() if (d / "password").exists())
    typer.echo(
        f"NATS identities of pipeline {p.name} in {out}: {', '.join(names)}; TLS {'on' if sec.tls else 'off'}"
    )
