"""One submitted request as the gateway holds it: its events in arrival order, where the client's
stream stands, and which attempts of each stage it takes events from."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Final

from libs.common.envelopes import ClientEvent, ClientEventType, ResumePoint, TextDelta
from services.gateway.errors import APIError
from services.gateway.event_trust import Attempts

BACKSTOP_S = 3.0
"""The gateway's own timeout fires this long after a request's deadline, seconds."""
EXPIRED: Final = None
"""Put in a handle's queue by its one deadline timer (:meth:`RequestHandle.events`): nothing
ended the request in time."""


class RequestHandle:
    """The events of one submitted request, in arrival order, bounded by its deadline.

    It also keeps where the client's stream stands — the thinker's text deltas so far and
    whether its ``text_done`` came — and, per stage, the oldest attempt still let through: when a
    request moves to another replica the orchestrator asks for that position and raises the
    fence in one step (:meth:`resume_point`), so the new attempt goes on exactly where the
    client is and nothing the old one still sends gets through."""

    def __init__(self, request_id: str, deadline_ns: int) -> None:
        self.request_id = request_id
        self.deadline_ns = deadline_ns
        self.queue: asyncio.Queue[ClientEvent | None] = asyncio.Queue()
        """The events let through, in order; :data:`EXPIRED` after them once the deadline passed."""
        self.first: ClientEvent | None = None
        """The request's first event (stays here after it is taken from the queue)."""
        self.arrived = asyncio.Event()
        """Set with the first event."""
        self.admission: tuple[bytes, dict[str, str]] | None = None
        """The admission as it was published (body, headers), to be sent again after a reconnect
        (``PipelineClient._admit_again``)."""
        self.attempts = Attempts()
        """Per stage the newest attempt announced and the replica bound to each attempt
        (:mod:`services.gateway.event_trust`)."""
        self._fence = self.attempts.fence
        """Stage → the oldest attempt whose events are let through (the newest announced)."""
        self._deltas: list[tuple[list[int], str]] = []
        """The thinker's text deltas the client has, as ``(token_ids, text)``: plain tuples, as the
        events were validated when decoded (:class:`TextDelta` is built for a :meth:`resume_point`)."""
        self._text_done = False
        self._next_seq: dict[tuple[int, int], int] = {}
        """(stage, attempt) → the ``seq`` of the next event expected from it."""
        self.gaps = 0
        """Events found missing (each gap once)."""
        self._held: dict[tuple[int, int], dict[int, ClientEvent]] = {}
        """Events that came after a gap, by ``seq``, until their sender has sent the missing ones
        again (it keeps them until this gateway confirms them)."""
        self._audio_seq: dict[int, int] = {}
        """Stage → the last input chunk whose audio arrived."""
        self._audio_done: set[int] = set()

    def put(self, event: ClientEvent) -> bool:
        """Take ``event`` unless it comes from a fenced-off attempt or was taken already (then
        False). Events of a stage attempt reach the client in ``seq`` order: one that comes after
        a gap (events lost on the way: a broker restart drops what it held) waits here until its
        sender, told by its next question (:meth:`next_seq`), has sent the missing ones again."""
        if self.fenced(event):
            return False
        if event.stage is None:
            return self._take(event)
        key = (event.stage, event.attempt)
        expected = self._next_seq.get(key, 0)
        if event.seq < expected:
            return False  # sent again, and it had arrived
        if event.seq > expected:
            held = self._held.setdefault(key, {})
            if event.seq in held:
                return False
            if not held:
                self.gaps += 1
            held[event.seq] = event
            return True
        self._next_seq[key] = expected + 1
        taken = self._take(event)
        held = self._held.get(key)
        if held is not None:  # events waited behind this one
            while self._next_seq[key] in held:
                self._take(held.pop(self._next_seq[key]))
                self._next_seq[key] += 1
            if not held:
                del self._held[key]
        return taken

    def fenced(self, event: ClientEvent) -> bool:
        """Whether ``event`` comes from an attempt older than the client's stream now takes."""
        return event.stage is not None and event.attempt < self._fence.get(event.stage, 1)

    def next_seq(self, key: tuple[int, int]) -> int:
        """The ``seq`` of the next event the client's stream takes from stage attempt ``key``."""
        return self._next_seq.get(key, 0)

    def received(self, stage: int, attempt: int) -> ResumePoint:
        """How far the client's stream of a stage attempt has got, for the worker running it: not
        ``known`` once the request has moved past the attempt (nothing more of it is taken)."""
        if attempt < self._fence.get(stage, 1):
            return ResumePoint(known=False)
        return ResumePoint(known=True, next_seq=self.next_seq((stage, attempt)))

    def _take(self, event: ClientEvent) -> bool:
        """Let ``event`` through to the client (False: an audio chunk the client has)."""
        if event.type == ClientEventType.TEXT:
            self._deltas.append((event.token_ids, event.text))
        elif event.type == ClientEventType.TEXT_DONE:
            if self._text_done:
                return False  # an attempt after a move that found the text complete
            self._text_done = True
        elif event.type == ClientEventType.AUDIO and event.stage is not None and event.in_seq is not None:
            if event.in_seq <= self._audio_seq.get(event.stage, -1):
                return False  # the attempt after a move decoded a chunk the client has
            self._audio_seq[event.stage] = event.in_seq
        elif event.type == ClientEventType.AUDIO_DONE and event.stage is not None:
            if event.stage in self._audio_done:
                return False
            self._audio_done.add(event.stage)
        if self.first is None:
            self.first = event
            self.arrived.set()
        self.queue.put_nowait(event)
        return True

    def resume_point(self, stage: int, attempt: int, text: bool) -> ResumePoint:
        """Let only ``attempt`` and later of ``stage`` through from now on, and say where the
        client's stream stands: the text deltas when ``stage`` sends text (the thinker, the
        listener), else its audio."""
        self._fence[stage] = max(self._fence.get(stage, 1), attempt)
        if not text:
            return ResumePoint(
                known=True, audio_seq=self._audio_seq.get(stage), audio_done=stage in self._audio_done
            )
        deltas = [TextDelta(token_ids=ids, text=text) for ids, text in self._deltas]
        return ResumePoint(known=True, deltas=deltas, text_done=self._text_done)

    @property
    def seconds_left(self) -> float:
        """Time until the gateway's own timeout: ``BACKSTOP_S`` after the request's deadline
        (workers and orchestrators normally answer at the deadline itself; this covers a bus or
        orchestrator outage), seconds."""
        return (self.deadline_ns - time.time_ns()) / 1e9 + BACKSTOP_S

    async def events(self) -> AsyncIterator[ClientEvent]:
        """Yield events until the caller stops; raises :func:`timed_out` when nothing has ended
        the request within :attr:`seconds_left`.

        One timer per iteration, not one timeout per event: :attr:`seconds_left` is read once,
        and ``loop.call_later`` (the loop's monotonic clock) puts :data:`EXPIRED` behind the events
        already queued when it has passed; the events before it still go out, as they did when
        each wait had its own timeout. A cancellation (a client hang-up) is never swallowed: the
        wait is a plain ``queue.get``."""
        queue = self.queue
        timer = asyncio.get_running_loop().call_later(max(self.seconds_left, 0.0), queue.put_nowait, EXPIRED)
        try:
            while True:
                event = queue.get_nowait() if queue.qsize() else await queue.get()
                if event is EXPIRED:
                    raise timed_out()
                yield event
        finally:
            timer.cancel()


def timed_out() -> APIError:
    return APIError(504, "the request did not finish before its deadline", "timeout")
