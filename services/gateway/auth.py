"""API keys at the gateway: which keys are valid, the check every ``/v1/*`` route depends on, and
the start-up rule for a gateway with no keys (docs/security.md, "API keys").

A client sends ``Authorization: Bearer <key>`` (what the official ``openai`` client sends for its
``api_key``). The presented key and every configured key are compared as SHA-256 digests with
:func:`hmac.compare_digest`, all of them every time, so neither the time taken nor an early exit
tells which key matched or how much of a key was right.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from libs.common.settings import GatewaySettings
from services.gateway.errors import APIError

log = logging.getLogger(__name__)

GENERATED_KEY_PREFIX = "omr-"
"""Keys the gateway generates start with this (easy to spot in a secret scanner)."""


class AuthConfigError(Exception):
    """The gateway must not start with this authentication set-up; the message is one line."""


@dataclass(frozen=True)
class ApiKeys:
    """The valid keys, kept as SHA-256 digests only."""

    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, keys: list[str]) -> ApiKeys:
        return cls(tuple(_digest(k) for k in keys))

    def match(self, presented: str) -> str | None:
        """The principal of the key ``presented`` (``key:`` and 12 hex digits of its digest:
        loggable, not the key), or None when it is none of them."""
        d = _digest(presented)
        found = b""
        for k in self.digests:  # every key, no early exit
            if hmac.compare_digest(d, k):
                found = k
        return f"key:{found.hex()[:12]}" if found else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_keys_file(path: Path) -> list[str]:
    """The keys of a keys file: one per line; blank lines and everything after ``#`` ignored."""
    keys = []
    for line in path.read_text().splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


def generate_key_file(path: Path) -> None:
    """Write a new random key (32 bytes from :mod:`secrets`, URL-safe base64) to ``path``, mode
    0600, unless the file appeared meanwhile (another gateway on the same volume made it)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(f"# omnirelay gateway API key, generated at first start\n{GENERATED_KEY_PREFIX}")
        f.write(f"{secrets.token_urlsafe(32)}\n")
    log.info(
        "generated an API key into %s (mode 0600); clients send it as 'Authorization: Bearer <key>'",
        path,
    )


def configured_keys(settings: GatewaySettings) -> list[str]:
    """Every key of ``OMNIRELAY_API_KEYS`` and ``OMNIRELAY_API_KEYS_FILE``. With
    ``OMNIRELAY_GENERATE_API_KEY`` the file is optional: generated when it is missing and no key
    is set, left alone when keys are set. Raises :class:`AuthConfigError` for a keys file that is
    missing (and not optional) or holds no key."""
    keys = [k.strip() for k in settings.api_keys.split(",") if k.strip()]
    path = settings.api_keys_file
    if path is None:
        return keys
    if not path.exists() and settings.generate_api_key:
        if keys:
            return keys
        generate_key_file(path)
    if not path.is_file():
        raise AuthConfigError(f"OMNIRELAY_API_KEYS_FILE: {path} does not exist")
    from_file = read_keys_file(path)
    if not from_file:
        raise AuthConfigError(f"OMNIRELAY_API_KEYS_FILE: {path} holds no key")
    log.info("API keys read from %s", path)
    return keys + from_file


def load_api_keys(settings: GatewaySettings) -> ApiKeys | None:
    """The keys the gateway requires, or None to serve without authentication: allowed on a
    loopback address (with a warning) or with ``OMNIRELAY_ALLOW_NO_AUTH=1`` (a louder one);
    otherwise raises :class:`AuthConfigError`."""
    keys = configured_keys(settings)
    if keys:
        log.info("API keys required on /v1/*: %d configured", len(keys))
        return ApiKeys.of(keys)
    if is_loopback(settings.host):
        log.warning(
            "no API keys configured: serving WITHOUT authentication on %s (loopback only); set "
            "OMNIRELAY_API_KEYS or OMNIRELAY_API_KEYS_FILE before exposing this gateway",
            settings.host,
        )
        return None
    if settings.allow_no_auth:
        log.warning(
            "UNSAFE: no API keys configured and OMNIRELAY_ALLOW_NO_AUTH=1: anyone who reaches %s:%d "
            "may use this gateway",
            settings.host,
            settings.port,
        )
        return None
    raise AuthConfigError(
        f"refusing to serve on {settings.host} without API keys: set OMNIRELAY_API_KEYS or "
        "OMNIRELAY_API_KEYS_FILE (or OMNIRELAY_ALLOW_NO_AUTH=1, unsafe)"
    )


def unauthorized(message: str) -> APIError:
    """OpenAI's 401: ``invalid_api_key``, with ``WWW-Authenticate: Bearer``."""
    return APIError(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def authorize(request: Request) -> None:
    """The dependency of every ``/v1/*`` route: a valid bearer key, or 401. Sets
    ``request.state.principal``: the key's fingerprint, or ``client:<address>`` when the gateway
    runs without keys (what per-client limits count by)."""
    client = request.client.host if request.client else "-"
    request.state.principal = principal_of(request.app.state.api_keys, bearer(request.headers), client)


def bearer(headers: Mapping[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def principal_of(keys: ApiKeys | None, presented: str | None, client: str) -> str:
    """Who presents ``presented``: its key's fingerprint; ``client:<address>`` for a gateway
    without keys; a 401 when the key is missing or none of the configured ones."""
    if keys is None:
        return f"client:{client}"
    if presented is None:
        raise unauthorized("no API key provided: send it as 'Authorization: Bearer <key>'")
    principal = keys.match(presented)
    if principal is None:
        raise unauthorized("incorrect API key provided")
    return principal
