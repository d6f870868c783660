"""Waiting for a realtime server event with the official client's connection."""

from __future__ import annotations

import asyncio
from typing import Any


async def until_event(conn: Any, kind: str, seen: list | None = None, timeout_s: float = 60.0) -> Any:
    """The next event of type ``kind`` (those before it appended to ``seen``); fails after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while True:
            event = await conn.recv()
            if seen is not None:
                seen.append(event)
            if event.type == kind:
                return event
