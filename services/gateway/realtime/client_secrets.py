"""Short-lived keys for browsers (``POST /v1/realtime/client_secrets``): a client secret lets its
holder open realtime sessions, as the API key that minted it would, until it expires.

A secret is ``ek_`` + the base64url of ``principal|expires_at|nonce`` + ``.`` + the base64url of
its HMAC-SHA256. The HMAC key is derived from the gateway's configured API keys (their digests),
so every gateway with the same keys accepts the secrets of the others and nothing is stored; a
secret stops working when it expires or when the keys change. A gateway without keys takes any
key, secrets included.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

from pydantic import BaseModel, Field

from services.gateway.auth import ApiKeys

PREFIX = "ek_"
DEFAULT_TTL_S = 600
"""OpenAI's default: ten minutes."""


class ExpiresAfter(BaseModel):
    anchor: str = Field(default="created_at", pattern="^created_at$")
    seconds: int = Field(default=DEFAULT_TTL_S, ge=10, le=7200)


class ClientSecretRequest(BaseModel):
    """OpenAI's body: when the secret expires, and (accepted, not bound to the secret) a session."""

    expires_after: ExpiresAfter = ExpiresAfter()
    session: dict | None = None


def _key(keys: ApiKeys) -> bytes:
    return hashlib.sha256(b"omnirelay client secrets\0" + b"".join(sorted(keys.digests))).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(keys: ApiKeys, principal: str, ttl_s: int, now: float | None = None) -> tuple[str, int]:
    """A secret for ``principal`` and when it expires (Unix seconds)."""
    expires_at = int((time.time() if now is None else now) + ttl_s)
    payload = f"{principal}|{expires_at}|{secrets.token_hex(8)}".encode()
    mac = hmac.new(_key(keys), payload, hashlib.sha256).digest()
    return f"{PREFIX}{_b64(payload)}.{_b64(mac)}", expires_at


def principal_of_secret(keys: ApiKeys, secret: str, now: float | None = None) -> str | None:
    """The principal of a valid, unexpired ``secret``; None for any other string."""
    if not secret.startswith(PREFIX) or secret.count(".") != 1:
        return None
    body, mac = secret[len(PREFIX) :].split(".")
    try:
        payload, given = _unb64(body), _unb64(mac)
    except ValueError:
        return None
    if not hmac.compare_digest(hmac.new(_key(keys), payload, hashlib.sha256).digest(), given):
        return None
    principal, expires_at, _ = payload.decode().rsplit("|", 2)
    return principal if int(expires_at) > (time.time() if now is None else now) else None
