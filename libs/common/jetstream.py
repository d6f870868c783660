"""A JetStream context whose ``publish`` costs less on the way to the stream's acknowledgement:
one wildcard reply subscription per connection, a plain future per publish, the ack's fields read
directly. Errors are nats-py's (``TimeoutError``, ``NoStreamResponseError``, ``APIError``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck
from nats.js.errors import APIError, NoStreamResponseError


class JetStream(JetStreamContext):
    """``nc.jetstream()`` with the lean :meth:`publish` (everything else is nats-py's)."""

    def __init__(self, nc: NATS, timeout: float = 5.0) -> None:
        super().__init__(nc, timeout=timeout)
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()
        self._reply_prefix: str | None = None
        self._subscribing: asyncio.Lock = asyncio.Lock()

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> PubAck:
        """Publish to a stream and wait for its acknowledgement (``timeout`` seconds)."""
        if stream is not None or msg_ttl is not None:  # rarer headers: nats-py adds them
            return await super().publish(subject, payload, timeout, stream, headers, msg_ttl)
        prefix = self._reply_prefix or await self._subscribe_replies()
        token = str(next(self._tokens))
        ack: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = ack
        try:
            await self._nc.publish(subject, payload, reply=prefix + token, headers=headers)
            async with asyncio.timeout(self._timeout if timeout is None else timeout):
                msg = await ack
        except TimeoutError:
            raise NatsTimeout from None
        finally:
            self._waiting.pop(token, None)
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            raise NoStreamResponseError
        resp = json.loads(msg.data)
        if "error" in resp:
            raise APIError.from_error(resp["error"])
        return PubAck(
            stream=resp["stream"], seq=resp["seq"], domain=resp.get("domain"), duplicate=resp.get("duplicate")
        )

    async def _subscribe_replies(self) -> str:
        """The reply subscription, made on first use (nats-py restores it after a reconnect)."""
        async with self._subscribing:
            if self._reply_prefix is None:
                prefix = self._nc.new_inbox() + "."
                await self._nc.subscribe(prefix + "*", cb=self._on_reply)
                self._reply_prefix = prefix
        return self._reply_prefix

    async def _on_reply(self, msg: Msg) -> None:
        assert self._reply_prefix is not None
        ack = self._waiting.get(msg.subject[len(self._reply_prefix) :])
        if ack is not None and not ack.done():
            ack.set_result(msg)
