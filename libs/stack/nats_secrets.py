"""The secrets of a pipeline's NATS identities, generated on first start, and the server
configuration that checks them.

Layout under one directory (``<data dir>/nats-secrets`` under ``omnirelay up``; a volume written by
the ``nats-init`` service under compose), every file mode 0600, every directory 0700:

```
<root>/<identity>/password      one per identity (gateway, orchestrator, worker-<s>-<r>, operator)
<root>/<identity>/ca.pem        the CA the identity verifies the server with (when TLS is on)
<root>/server/route.password    what the servers of a cluster present to each other
<root>/server/{cert,key}.pem    the server's TLS certificate (tls.py), signed by
<root>/ca/{ca,ca-key}.pem       the CA generated on first start
```

A password is 32 random bytes (URL-safe base64, 43 characters); the server's configuration holds
only its bcrypt hash (:func:`authorization_block`). A secret that exists is kept, so a restart keeps
every identity's password; deleting a file and restarting rotates it (docs/security.md).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import bcrypt

from libs.common.nats_identities import Identity

PASSWORD_FILE = "password"
ROUTE_USER = "route"
BCRYPT_ROUNDS = 11
"""Cost of the stored password hashes (nats-server checks one per connection: about 0.1 s of CPU)."""


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600; parents 0700), atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _secret(path: Path) -> str:
    """The secret stored in ``path``, generated there first when missing."""
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


def password_file(root: Path, identity: str) -> Path:
    return root / identity / PASSWORD_FILE


def ensure_passwords(root: Path, names: list[str]) -> dict[str, str]:
    """Each identity's password, generated into ``<root>/<identity>/password`` when missing."""
    return {name: _secret(password_file(root, name)) for name in names}


def route_password(root: Path) -> str:
    """The cluster routes' password, generated when missing."""
    return _secret(root / "server" / "route.password")


def _user(identity: Identity, password: str) -> dict[str, object]:
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
    permissions: dict[str, object] = {
        "publish": {"allow": list(identity.publish)},
        "subscribe": {"allow": list(identity.subscribe)},
    }
    if identity.allow_responses:
        permissions["allow_responses"] = True
    return {"user": identity.name, "password": hashed, "permissions": permissions}


def authorization_block(identities: list[Identity], passwords: dict[str, str]) -> str:
    """nats-server's ``authorization`` block: one user per identity with its bcrypt-hashed
    password and its publish/subscribe allow lists (JSON values: nats-server's configuration
    format reads them, and a ``$`` inside quotes is literal). A client without a listed user and
    password is refused."""
    users = [_user(i, passwords[i.name]) for i in identities]
    return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"


def tls_block(cert: Path, key: Path, ca: Path | None = None, verify: bool = False) -> str:
    """A ``tls`` block (clients' port or, inside ``cluster``, the routes'): the server's certificate
    and key, and with ``verify`` a client certificate signed by ``ca`` required."""
    fields = {"cert_file": str(cert), "key_file": str(key)}
    if ca is not None:
        fields["ca_file"] = str(ca)
    body = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in fields.items())
    if verify:
        body += "  verify: true\n"
    return "tls {\n" + body + "  timeout: 5\n}\n"
