"""A pipeline's NATS security material in one place: every identity's secret, the server's
configuration blocks that check them, and TLS — what ``omnirelay up`` and the compose
``nats-init`` service (``omnirelay nats-secrets``) generate, and what a service is given.

Files (:mod:`libs.stack.nats_secrets` for the layout), written on first start and kept:

- ``<root>/<identity>/password`` (and, with TLS, ``ca.pem``; with mutual TLS ``cert.pem``,
  ``key.pem``): what the service of that identity reads; nothing else is in its directory, so a
  deployment can give each service its own directory only;
- ``<root>/server/auth.conf``: the clients' ``authorization`` block (bcrypt hashes) and ``tls``
  block, rewritten on every start from the pipeline (a replica added gets its identity);
- ``<root>/server/cluster-tls.conf``: with TLS, the routes' ``tls`` block for inside ``cluster {}``:
  a route must present a certificate the CA signed (compose's servers authenticate each other so;
  ``omnirelay up``'s routes, on loopback, with :attr:`NatsSecurity.route_password`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libs.common.nats_credentials import NatsAuth, auth_from
from libs.common.nats_identities import OPERATOR, identities
from libs.common.pipeline import PipelineConfig
from libs.stack.nats_secrets import (
    authorization_block,
    ensure_passwords,
    route_password,
    tls_block,
    write_private,
)
from libs.stack.nats_tls import CertFiles, ensure_ca, issue

SECRETS_DIR = "nats-secrets"
"""The directory under ``omnirelay up``'s data directory."""
LOCAL_HOSTS = ["127.0.0.1", "localhost"]
"""Names a local server's certificate is valid for."""


@dataclass(frozen=True)
class NatsSecurity:
    """What was generated under :attr:`root` and how a server and a client use it."""

    root: Path
    server_conf: str
    """The clients' ``authorization`` (and ``tls``) blocks, as ``server/auth.conf`` holds them."""
    cluster_conf: str
    """The routes' ``tls`` for inside ``cluster {}`` (empty without TLS)."""
    route_password: str
    tls: bool

    def identity_dir(self, identity: str) -> Path:
        return self.root / identity

    def env(self, identity: str, mounted_at: Path | None = None) -> dict[str, str]:
        """The environment of a service that connects as ``identity`` (its directory seen at
        ``mounted_at`` inside the service's container; by default where it was written)."""
        where = mounted_at or self.identity_dir(identity)
        env = {"OMNIRELAY_NATS_USER": identity, "OMNIRELAY_NATS_PASSWORD_FILE": str(where / "password")}
        if self.tls:
            env["OMNIRELAY_NATS_CA"] = str(where / "ca.pem")
            if (self.identity_dir(identity) / "cert.pem").exists():
                env |= {
                    "OMNIRELAY_NATS_CERT": str(where / "cert.pem"),
                    "OMNIRELAY_NATS_KEY": str(where / "key.pem"),
                }
        return env

    def credentials(self, identity: str = OPERATOR) -> NatsAuth:
        """``identity``'s credentials as a client on this machine (``omnirelay inspect``, tests)."""
        return auth_from(self.env(identity))


def prepare(
    root: Path,
    pipeline: PipelineConfig,
    tls: bool = False,
    mutual_tls: bool = False,
    hosts: list[str] | None = None,
    server_root: Path | None = None,
) -> NatsSecurity:
    """Generate what is missing under ``root`` for ``pipeline``'s identities and write the
    server's blocks. With ``tls``: the CA, a server certificate valid for ``hosts`` (default
    :data:`LOCAL_HOSTS`), the CA beside every identity's password, and with ``mutual_tls`` a client
    certificate per identity, required by the server. ``server_root`` is where the server sees
    ``root`` (another path inside its container), for the file paths in its blocks."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    ids = identities(pipeline)
    passwords = ensure_passwords(root, [i.name for i in ids])
    seen = server_root or root
    server_conf = authorization_block(ids, passwords)
    route_pw = route_password(root)
    cluster_conf = ""
    if tls:
        ca = ensure_ca(root / "ca")
        issue(
            ca,
            CertFiles(root / "server" / "cert.pem", root / "server" / "key.pem"),
            "nats",
            hosts or LOCAL_HOSTS,
            client=False,
        )
        write_private(root / "server" / "ca.pem", ca.cert.read_text())
        for ident in ids:
            write_private(root / ident.name / "ca.pem", ca.cert.read_text())
            if mutual_tls:
                issue(
                    ca,
                    CertFiles(root / ident.name / "cert.pem", root / ident.name / "key.pem"),
                    ident.name,
                    [],
                    client=True,
                )
        files = [seen / "server" / n for n in ("cert.pem", "key.pem", "ca.pem")]
        server_conf += tls_block(*files, verify=mutual_tls)
        cluster_conf = tls_block(*files, verify=True)  # a route presents the servers' certificate
    write_private(root / "server" / "auth.conf", server_conf)
    write_private(root / "server" / "cluster-tls.conf", cluster_conf)
    return NatsSecurity(root, server_conf, cluster_conf, route_pw, tls)
