"""Helpers for tests that play a service on the bus."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg

from libs.common.envelopes import decode

E = TypeVar("E")


def collect(queue: asyncio.Queue[E], cls: type[E]) -> Callable[[Msg], Awaitable[None]]:
    """A subscription callback that decodes every message as ``cls`` into ``queue``."""

    async def put(msg: Msg) -> None:
        queue.put_nowait(decode(cls, msg.data))

    return put
