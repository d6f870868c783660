"""One attempt's client events (core NATS, at most once), kept by their sender until the gateway
confirms them: a :class:`ResumeQuery` on the request's ``out`` subject is answered with the first
event the gateway lacks (``next_seq``), which is sent again with those after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from libs.common.envelopes import MalformedMessage, ResumePoint, ResumeQuery, decode
from libs.common.publish import NOT_NOW, publish_core, until_connected

log = logging.getLogger(__name__)

ASK_PERIOD_S = 0.5  # how often a running attempt with unconfirmed events asks the gateway, s
ASK_TIMEOUT_S = 1.0  # how long one question waits for the answer, s
RETRY_S = 0.1  # pause before asking again while the attempt waits for its confirmation, s
GATEWAY_GONE_S = 5.0  # the gateway is gone once nobody has taken the question this long, s


class ClientStream:
    """The unconfirmed client events of one (request, stage attempt). Clock: ``time.monotonic()``."""

    def __init__(
        self, nc: NATS, subject: str, query: ResumeQuery, flushed: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """``flushed()`` returns once the events handed to the worker's sender are on the connection."""
        self._nc = nc
        self._subject = subject
        self._query = query.encode()
        self._flushed = flushed
        self._events: list[bytes] = []  # events confirmed … sent - 1
        self.confirmed = 0  # events 0 … confirmed - 1 have reached the gateway
        self.ended = False  # nothing more is delivered: the gateway no longer takes them
        self._unanswered_since: float | None = None
        self._asking = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None  # the periodic questions, or the last ones

    @property
    def sent(self) -> int:
        """Events handed to the bus so far (the next event's ``seq``)."""
        return self.confirmed + len(self._events)

    def add(self, data: bytes) -> None:
        """Keep event ``seq`` = :attr:`sent`, once handed to the worker's sender."""
        self._events.append(data)
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._ask_periodically())

    async def confirm(self, upto: int) -> None:
        """Ask until events ``0 … upto - 1`` are confirmed or the stream has ended."""
        while self.confirmed < upto and not self.ended:
            await self.ask()
            if self.confirmed < upto and not self.ended:
                await asyncio.sleep(RETRY_S)

    def finish(self, timeout_s: float) -> None:
        """The attempt ended: go on asking in the background for at most ``timeout_s`` (0: stop)."""
        if self._watch is not None:
            self._watch.cancel()
        if timeout_s <= 0 or self.ended or not self._events:
            return
        self._watch = asyncio.get_running_loop().create_task(self._finish(timeout_s))

    async def _finish(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self.confirm(self.sent)
        except TimeoutError:
            log.warning("%s: %d event(s) not confirmed by the deadline", self._subject, len(self._events))
        except Exception:
            log.exception("%s: delivering the last events failed", self._subject)

    async def _ask_periodically(self) -> None:
        while not self.ended:
            await asyncio.sleep(ASK_PERIOD_S)
            try:
                await self.ask()
            except Exception:
                log.exception("%s: asking the gateway failed", self._subject)

    async def ask(self) -> None:
        """Ask the gateway how far the stream has got; forget what it has, resend what it lacks."""
        async with self._asking:
            if self.ended or not self._events:
                return
            asked_after = self.sent
            if self._flushed is not None:
                await self._flushed()
            await until_connected(self._nc)
            try:
                reply = await self._nc.request(self._subject, self._query, timeout=ASK_TIMEOUT_S)
                point = decode(ResumePoint, reply.data)
            except NoRespondersError:
                now = time.monotonic()
                self._unanswered_since = self._unanswered_since or now
                if now - self._unanswered_since >= GATEWAY_GONE_S:
                    log.info(
                        "%s: the gateway is gone; %d event(s) not delivered", self._subject, len(self._events)
                    )
                    self._end()
                return
            except (NatsTimeoutError, MalformedMessage, *NOT_NOW):
                return
            self._unanswered_since = None
            if not point.known:
                self._end()
                return
            done = min(max(point.next_seq - self.confirmed, 0), len(self._events))
            del self._events[:done]
            self.confirmed += done
            for data in self._events[: max(asked_after - self.confirmed, 0)]:
                await publish_core(self._nc, self._subject, data)

    def _end(self) -> None:
        self.ended = True
        self._events.clear()
