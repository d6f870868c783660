"""Reading a durable JetStream pull consumer through standing pull requests.

Pull requests stand at the server asking for up to ``batch`` messages in all; each message is
handled the moment it arrives, and the requests are topped up once fewer than half of ``batch``
are still asked for. Every delivered message uses up one requested; a request that expires (408)
or is ended (409) reports what it left in ``Nats-Pending-Messages``. After silence longer than a
request lives (the requests were lost), the count starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.common.subjects import JS_API

log = logging.getLogger(__name__)

PENDING_MESSAGES = "Nats-Pending-Messages"
"""Header of a 408/409 status: messages its pull request left unfulfilled."""
STATUS = "Status"
NEXT_API = JS_API + ".CONSUMER.MSG.NEXT.{stream}.{consumer}"
LOST_GRACE_S = 2.0
"""Silence beyond a request's lifetime after which the standing requests count as lost, seconds."""
WATCH_PERIOD_S = 1.0

Handler = Callable[[Msg], Awaitable[None]]


class PullConsumer:
    """Hands every message of durable pull consumer ``consumer`` (of ``stream``) to ``handle``."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        consumer: str,
        handle: Handler,
        *,
        batch: int = 64,
        expires_s: float = 5.0,
        name: str = "",
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self._nc = nc
        self._api = NEXT_API.format(stream=stream, consumer=consumer)
        self._handle = handle
        self.batch = batch
        self.expires_s = expires_s
        self._name = name or consumer
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._asked = 0
        """Messages requested by the standing pull requests and not delivered yet."""
        self._heard = time.monotonic()
        """When the server last sent anything on the inbox (``time.monotonic()``, s)."""
        self._stopped = False

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)
        await self._top_up()
        self._watchdog = asyncio.create_task(self._watch(), name=f"pull-watchdog:{self._name}")

    async def stop(self) -> None:
        """Ask for nothing more and stop handing messages over (unhandled ones are redelivered)."""
        self._stopped = True
        if self._watchdog:
            self._watchdog.cancel()
        if self._sub:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        self._heard = time.monotonic()
        status = msg.headers.get(STATUS) if msg.headers else None
        if status is not None and not msg.data:
            if self._on_status(status, msg.headers or {}):
                await self._top_up()
            return
        self._asked -= 1
        await self._top_up()
        if self._stopped:
            return
        try:
            await self._handle(msg)
        except Exception:
            log.exception("%s: handling a message failed", self._name)

    def _on_status(self, status: str, headers: dict[str, str]) -> bool:
        """Account for a status message; True when the requests may be topped up now."""
        if status == "100":  # idle heartbeat / flow control: nothing to account
            return False
        try:
            self._asked = max(self._asked - int(headers[PENDING_MESSAGES]), 0)
            return True
        except (KeyError, ValueError):
            if status == "408":  # expired without saying what it left: keep counting
                return True
            log.warning("%s: pull request ended: %s %s", self._name, status, headers.get("Description"))
            self._asked = 0
            return False

    async def _top_up(self) -> None:
        """Ask for more once fewer than half of ``batch`` messages are still asked for."""
        if self._stopped or self._asked > self.batch // 2:
            return
        more = self.batch - self._asked
        self._asked = self.batch
        body = json.dumps({"batch": more, "expires": int(self.expires_s * 1e9)}).encode()
        try:
            await self._nc.publish(self._api, body, reply=self._inbox)
        except Exception as e:
            self._asked -= more
            log.warning("%s: pull request failed (%r); the watchdog retries", self._name, e)

    async def _watch(self) -> None:
        """Start over after the server's silence, and top up what a refused request left short."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            if time.monotonic() - self._heard > self.expires_s + LOST_GRACE_S:
                if self._asked:
                    log.info("%s: no word from the server; pull requests renewed", self._name)
                self._asked = 0
                self._heard = time.monotonic()
            await self._top_up()


class InProgress:
    """A context manager that, while a handler works on ``msg``, tells JetStream every
    ``period_s`` seconds that it is in progress (its ``ack_wait`` starts again)."""

    def __init__(self, msg: Msg, period_s: float) -> None:
        self._msg, self._period_s = msg, period_s
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task[None] | None = None

    def __enter__(self) -> InProgress:
        self._timer = asyncio.get_running_loop().call_later(self._period_s, self._tick)
        return self

    def __exit__(self, *_: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _tick(self) -> None:
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._send())
        self._timer = asyncio.get_running_loop().call_later(self._period_s, self._tick)

    async def _send(self) -> None:
        with contextlib.suppress(Exception):  # the broker is away: the message comes again
            await self._msg.in_progress()
