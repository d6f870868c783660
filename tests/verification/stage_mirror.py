"""The fault suite's record of what the stages stream stored: a JetStream mirror of it.

The chunk judge (:mod:`tests.verification.audio_accounting`) needs every text chunk the talker was sent and
every code chunk code2wav was sent, a redo's copies included. The stages stream is a work queue (a
message is gone once its worker acknowledges it) and no second consumer may read its subjects, and a
core NATS subscription misses what is published while it reconnects after a broker restart. A mirror
misses nothing the stream stored: JetStream keeps an acknowledged message of a work-queue stream until
its mirrors have it, the mirror is on disk like the stream, and after a broker restart it resumes
where it stopped (seen here: about 10 s after the broker is back). It keeps the stream's sequence
numbers, so a message the mirror does not have shows as a number it skipped: :class:`MirrorRead`
counts those, and the row then says its reference is incomplete instead of judging the pipeline on
it.

The mirror is the suite's only: the pipeline's services never see it. Its one effect on them is
that the stages stream may hold acknowledged messages a little longer (until the mirror has read
them), which no consumer is delivered again.

Clocks: ``time.monotonic()`` of this process, seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from libs.common.subjects import Subjects

T = TypeVar("T")
CATCH_UP_S = 60.0
"""How long a read waits for the mirror to hold everything the stream stored, seconds."""


def mirror_name(pipeline: str) -> str:
    """The mirror's stream name: the stages stream's with ``_MIRROR``."""
    return f"{Subjects(pipeline).stages_stream}_MIRROR"


@dataclass(frozen=True)
class StoredMessage:
    seq: int
    subject: str
    headers: dict[str, str] | None
    data: bytes


@dataclass(frozen=True)
class MirrorRead:
    """The stream's messages from one sequence on, as the mirror holds them."""

    messages: list[StoredMessage]
    unread: int
    """Sequence numbers in the range read that the mirror does not hold."""


class StageMirror:
    """A mirror of pipeline ``pipeline``'s stages stream on connection ``nc`` (created if absent,
    with the stream's replicas)."""

    def __init__(self, nc, pipeline: str) -> None:
        self._js = nc.jetstream()
        self._origin = Subjects(pipeline).stages_stream
        self.name = mirror_name(pipeline)

    async def ensure(self) -> None:
        """Create the mirror unless it exists, and wait (at most :data:`CATCH_UP_S`) until it
        reads from the stream: a message acknowledged before that is not kept for it."""
        from nats.js.api import StorageType, StreamConfig, StreamSource
        from nats.js.errors import NotFoundError

        try:
            await self._js.stream_info(self.name)
        except NotFoundError:
            origin = await self._js.stream_info(self._origin)
            await self._js.add_stream(
                StreamConfig(
                    name=self.name,
                    mirror=StreamSource(name=self._origin),
                    storage=StorageType.FILE,
                    num_replicas=origin.config.num_replicas,
                )
            )
        deadline = time.monotonic() + CATCH_UP_S
        while time.monotonic() < deadline:
            source = (await self._js.stream_info(self.name)).mirror
            if source is not None and source.active is not None and source.active >= 0:
                return
            await asyncio.sleep(0.1)

    async def last_seq(self) -> int:
        """The stages stream's last sequence number now."""
        return (await self._answered(lambda: self._js.stream_info(self._origin))).state.last_seq

    async def _answered(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, asked again while JetStream does not answer in time (a cluster electing a
        stream's leader after a node's death), for at most :data:`CATCH_UP_S`."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeoutError
        from nats.js.errors import ServiceUnavailableError

        deadline = time.monotonic() + CATCH_UP_S
        while True:
            try:
                return await call()
            except (NatsTimeoutError, NoRespondersError, ServiceUnavailableError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)

    async def read_after(self, seq: int) -> MirrorRead:
        """Every message the stream stored after ``seq``, up to its last now, once the mirror has
        caught up with it (at most :data:`CATCH_UP_S`; what it still lacks then counts unread)."""
        from nats.js.errors import NotFoundError

        last = await self.last_seq()
        deadline = time.monotonic() + CATCH_UP_S
        while time.monotonic() < deadline:
            if (await self._answered(lambda: self._js.stream_info(self.name))).state.last_seq >= last:
                break
            await asyncio.sleep(0.5)
        messages, unread = [], 0
        for s in range(seq + 1, last + 1):
            try:
                m = await self._answered(lambda s=s: self._js.get_msg(self.name, s))
            except NotFoundError:
                unread += 1
                continue
            messages.append(StoredMessage(s, m.subject, m.headers, m.data or b""))
        return MirrorRead(messages, unread)
