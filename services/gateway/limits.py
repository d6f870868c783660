"""Bounds on what one client may ask of the gateway: a request's input (all checked before it is
queued, its size before it is tokenized) and how many of its requests may run at once (429).

Every bound is a :class:`~libs.common.settings.GatewaySettings` field; docs/security.md lists
them with their defaults.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from libs.common.settings import GatewaySettings
from services.gateway.auth import is_loopback
from services.gateway.errors import APIError, bad_request

TOO_MANY_REQUESTS = 429
RETRY_AFTER_S = 1
"""``Retry-After`` of a 429, seconds: a slot frees when one of the client's requests ends."""


@dataclass(frozen=True)
class InputLimits:
    """What a single chat or completion request may carry."""

    max_messages: int
    max_prompt_chars: int
    """Characters of all messages' text (chat) or of the prompt (completions) together."""
    max_stop: int
    max_tokens: int
    """Most tokens a request may generate; also the cap of the default (what the context leaves)."""
    allow_ignore_eos: bool
    max_buffered_events: int
    """Events a streamed response may have waiting for its client (0: no limit)."""

    @classmethod
    def of(cls, settings: GatewaySettings) -> InputLimits:
        allow = settings.allow_ignore_eos
        return cls(
            max_messages=settings.max_messages,
            max_prompt_chars=settings.max_prompt_chars,
            max_stop=settings.max_stop,
            max_tokens=settings.max_tokens_limit,
            allow_ignore_eos=is_loopback(settings.host) if allow is None else allow,
            max_buffered_events=settings.max_buffered_events,
        )

    def check_messages(self, count: int) -> None:
        if count > self.max_messages:
            raise bad_request(
                f"{count} messages; this server takes at most {self.max_messages}",
                "messages",
                "too_many_messages",
            )

    def check_prompt(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise bad_request(
                f"the prompt has {chars} characters; this server takes at most {self.max_prompt_chars}",
                param,
                "prompt_too_long",
            )

    def check_sampling(self, stop: str | list[str] | None, ignore_eos: bool) -> None:
        if isinstance(stop, list) and len(stop) > self.max_stop:
            raise bad_request(
                f"{len(stop)} stop sequences; at most {self.max_stop}", "stop", "too_many_stop_sequences"
            )
        if ignore_eos and not self.allow_ignore_eos:
            raise bad_request(
                "'ignore_eos' is not allowed on this server", "ignore_eos", "unsupported_parameter"
            )

    def check_max_tokens(self, asked: int | None, param: str) -> None:
        if asked is not None and asked > self.max_tokens:
            raise bad_request(
                f"{param}={asked}; this server generates at most {self.max_tokens} tokens per request",
                param,
                "max_tokens_too_large",
            )


def check_text(value: object, path: str = "") -> None:
    """Every string in ``value`` (a request's fields, as dumped) is valid Unicode: a lone
    surrogate (U+D800..U+DFFF, which JSON's ``\\ud83c`` can carry) has no UTF-8 form, and the
    tokenizer and the bus's encoder fail on it. Else a 400 on its path (``messages.0.content``)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                f"{path}: not valid Unicode text (a lone surrogate)", path or None, "invalid_request"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, f"{path}.{i}")


DEFAULT_LIMITS = InputLimits.of(GatewaySettings.model_construct())
"""The settings' defaults, environment aside (a loopback gateway's: ``ignore_eos`` allowed)."""


class ConcurrencyLimit:
    """At most ``limit`` requests at once per principal (an API key, or a client address when
    the gateway runs without keys); 0: no limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running: Counter[str] = Counter()

    def acquire(self, principal: str) -> None:
        """Take a slot for ``principal`` or raise the 429."""
        if self.limit and self.running[principal] >= self.limit:
            raise APIError(
                TOO_MANY_REQUESTS,
                f"too many requests at once for this API key (at most {self.limit}); retry when one has ended",
                "too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.running[principal] += 1

    def release(self, principal: str) -> None:
        self.running[principal] -= 1
        if self.running[principal] <= 0:
            del self.running[principal]


SLOT_KEY = "concurrency_slot"
"""Where :func:`admit` leaves the principal whose slot :class:`SlotRelease` gives back."""


async def admit(request: Request) -> None:
    """The dependency after :func:`~services.gateway.auth.authorize` on every ``/v1/*`` route:
    a slot of the client's concurrency, held until the response has been sent
    (:class:`SlotRelease`)."""
    limit: ConcurrencyLimit = request.app.state.concurrency
    principal = request.state.principal
    limit.acquire(principal)
    request.scope.setdefault("state", {})[SLOT_KEY] = principal


class SlotRelease:
    """ASGI middleware giving back a request's concurrency slot once the application is done with
    it: after the last byte of a streamed response, or after an error."""

    def __init__(self, app: Any, limit: ConcurrencyLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            principal = scope.get("state", {}).pop(SLOT_KEY, None)
            if principal is not None:
                self.limit.release(principal)
