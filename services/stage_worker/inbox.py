"""Per-request inbox: a request's delivered messages, handed out in ``Omni-Seq`` order."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from libs.common.envelopes import StageTask
from services.stage_worker.transfer_stats import TransferStats


@dataclass
class Delivery:
    """One received task/chunk message."""

    msg: Msg
    task: StageTask
    received_ns: int  # when the worker got it (wall clock, ns)
    transfer: TransferStats | None = None  # how it travelled (with --log-stats)
    received_s: float = field(default_factory=time.monotonic)  # when the worker got it (monotonic s)


class RequestInbox:
    """Reorders one request's chunks by sequence number."""

    def __init__(self, start_seq: int = 0) -> None:
        self._next_seq = start_seq
        self._waiting: dict[int, Delivery] = {}
        self._ready = asyncio.Event()

    def put(self, d: Delivery) -> bool:
        """Accept ``d``; False for a duplicate (a seq already handed out or already waiting)."""
        seq = d.task.seq
        if seq < self._next_seq or seq in self._waiting:
            return False
        self._waiting[seq] = d
        if seq == self._next_seq:
            self._ready.set()
        return True

    async def next(self) -> Delivery:
        """The delivery with the next sequence number (waits for it)."""
        while self._next_seq not in self._waiting:
            self._ready.clear()
            await self._ready.wait()
        self._next_seq += 1
        return self._waiting.pop(self._next_seq - 1)

    def held(self) -> list[Delivery]:
        """Deliveries received but not handed out yet."""
        return list(self._waiting.values())
