"""How a client proves who it is to NATS: user and password, and TLS (``OMNIRELAY_NATS_*``)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from libs.common.nats_identities import inbox_prefix

ENV_PREFIX = "OMNIRELAY_"


class NatsAuth(BaseModel):
    """A NATS identity and the TLS a client verifies the server with (all optional)."""

    nats_user: str | None = Field(default=None, description="NATS identity (gateway, orchestrator, ...)")
    nats_password: SecretStr | None = Field(default=None, description="the identity's password")
    nats_password_file: Path | None = Field(default=None, description="a file holding the password")
    nats_ca: Path | None = Field(default=None, description="PEM CA the server's certificate must chain to")
    nats_cert: Path | None = Field(default=None, description="client certificate (PEM), mutual TLS")
    nats_key: Path | None = Field(default=None, description="the client certificate's key (PEM)")

    @model_validator(mode="after")
    def _consistent(self) -> NatsAuth:
        if self.nats_password is not None and self.nats_password_file is not None:
            raise ValueError("give OMNIRELAY_NATS_PASSWORD or OMNIRELAY_NATS_PASSWORD_FILE, not both")
        has_password = self.nats_password is not None or self.nats_password_file is not None
        if has_password != (self.nats_user is not None):
            raise ValueError("OMNIRELAY_NATS_USER and a password (or password file) go together")
        if (self.nats_cert is None) != (self.nats_key is None):
            raise ValueError("OMNIRELAY_NATS_CERT and OMNIRELAY_NATS_KEY go together")
        if self.nats_cert is not None and self.nats_ca is None:
            raise ValueError("mutual TLS (OMNIRELAY_NATS_CERT) needs OMNIRELAY_NATS_CA")
        return self

    def password(self) -> str | None:
        """The password, read from its file when given as one (surrounding blanks dropped)."""
        if self.nats_password_file is not None:
            return self.nats_password_file.read_text().strip()
        return None if self.nats_password is None else self.nats_password.get_secret_value()

    def connect_options(self) -> dict[str, Any]:
        """nats-py ``connect`` keyword arguments: user, password, inbox prefix and TLS context."""
        opts: dict[str, Any] = {}
        if self.nats_user is not None:
            opts |= {
                "user": self.nats_user,
                "password": self.password(),
                "inbox_prefix": inbox_prefix(self.nats_user),
            }
        if self.nats_ca is not None:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.nats_ca))
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.nats_cert is not None and self.nats_key is not None:
                ctx.load_cert_chain(str(self.nats_cert), str(self.nats_key))
            opts["tls"] = ctx
        return opts


class NatsCredentials(NatsAuth, BaseSettings):
    """:class:`NatsAuth` read from the process's environment (``OMNIRELAY_NATS_*``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")


def auth_from(env: Mapping[str, str]) -> NatsAuth:
    """The :class:`NatsAuth` that the variables ``env`` name (not this process's environment)."""
    return NatsAuth.model_validate({k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items()})
