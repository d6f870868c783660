"""A worker's client events, one message per gateway per event-loop turn: the first event of a turn
goes at once, alone, the rest in the next turn (:func:`frames`), in the order added.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator

from nats.aio.client import Client as NATS

from libs.common.envelopes import pack_batch
from libs.common.publish import publish_core
from libs.common.subjects import Subjects

log = logging.getLogger(__name__)

MAX_WAITING_BYTES = 1 << 20  # bytes of events not yet taken by the send task beyond which adding waits
MAX_BATCH_BYTES = 64 << 10  # a batch carries up to this many bytes of bodies; a larger event goes alone


def frames(
    subjects: Subjects, gateway_id: str, events: list[tuple[str, bytes]], max_bytes: int = MAX_BATCH_BYTES
) -> Iterator[tuple[str, bytes]]:
    """The messages (subject, body) that carry ``events`` ((request id, body)) to ``gateway_id``, in
    order: each alone on its request's subject when all are of one request, when it is
    ``max_bytes`` or larger, or alone in its run; else in batches of at most ``max_bytes``."""
    runs: list[list[tuple[str, bytes]]] = [[event] for event in events]
    if len({request_id for request_id, _ in events}) > 1:
        runs, size = [[]], 0.0
        for request_id, body in events:
            alone = len(body) >= max_bytes
            if alone or size + len(body) > max_bytes:
                runs.append([])
                size = 0.0
            runs[-1].append((request_id, body))
            size = math.inf if alone else size + len(body)  # nothing joins a large event
    for run in runs:
        if len(run) == 1:
            yield subjects.out(gateway_id, run[0][0]), run[0][1]
        elif run:
            yield subjects.out_batch(gateway_id), pack_batch([body for _, body in run])


class ClientEventBatcher:
    """Collects a worker's client events and sends them per gateway once per turn."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects
        # gateway id -> (request id, event body) added since the send task last took them
        self._pending: dict[str, list[tuple[str, bytes]]] = {}
        self._waiting = 0  # bytes of _pending
        self._room = asyncio.Event()  # set when the send task has taken what waited
        self._sending: asyncio.Task[None] | None = None
        self._direct = False  # an event is being published at once
        self._turn_used = False  # an event went at once in this turn of the event loop
        self._added = 0
        self._handed = 0  # events handed to nats-py so far: always the oldest added
        self._progress = asyncio.Event()  # set whenever _handed grows

    async def add(self, gateway_id: str, request_id: str, body: bytes) -> None:
        """Send ``body`` (one client event of ``request_id``) to ``gateway_id``: at once when it is
        the turn's first and nothing waits, else with the turn's others in the next turn."""
        self._added += 1
        if not (self._turn_used or self._direct or self._pending or self._sending):
            self._turn_used, self._direct = True, True
            asyncio.get_running_loop().call_soon(self._next_turn)
            try:
                await publish_core(self._nc, self._subjects.out(gateway_id, request_id), body)
            finally:
                self._direct = False
                self._handed_over(1)
                self._start_sending()  # what came while it waited for the connection
            return
        self._pending.setdefault(gateway_id, []).append((request_id, body))
        self._waiting += len(body)
        self._start_sending()
        while self._waiting > MAX_WAITING_BYTES and self._sending is not None:
            self._room.clear()
            await self._room.wait()

    async def flushed(self) -> None:
        """Return once every event added before the call has been handed to nats-py."""
        target = self._added
        while self._handed < target:
            self._progress.clear()
            await self._progress.wait()

    def _handed_over(self, n: int) -> None:
        self._handed += n
        self._progress.set()

    def _next_turn(self) -> None:
        self._turn_used = False

    def _start_sending(self) -> None:
        if self._pending and self._sending is None and not self._direct:
            self._sending = asyncio.get_running_loop().create_task(self._send(), name="client-events")

    async def _send(self) -> None:
        try:
            while self._pending:
                pending, self._pending, self._waiting = self._pending, {}, 0
                self._room.set()
                try:
                    for gateway_id, events in pending.items():
                        for subject, body in frames(self._subjects, gateway_id, events):
                            await publish_core(self._nc, subject, body)
                finally:
                    self._handed_over(sum(len(events) for events in pending.values()))
        except Exception:  # their senders keep them until confirmed, and send them again
            log.exception("client events not sent")
        finally:
            self._sending = None
            self._room.set()
