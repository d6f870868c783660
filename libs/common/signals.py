"""Waiting for SIGINT/SIGTERM inside an asyncio program."""

from __future__ import annotations

import asyncio
import signal


def shutdown_event() -> asyncio.Event:
    """An event set when the process receives SIGINT or SIGTERM (handlers installed now)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def wait_for_shutdown() -> None:
    await shutdown_event().wait()
