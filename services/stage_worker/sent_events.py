"""The client events a worker has sent, kept for a while so that lost ones can be sent again.

Client events travel over core NATS, at most once: a broker restart or the death of a cluster node
drops those it held. The gateway notices a gap in an attempt's ``seq`` and asks the worker that sent
them (``ctl.replay.<s>.<r>``) for the missing ones; the worker answers from here. An attempt's
events are kept while it runs and ``KEEP_S`` after it ends (its last events may be the lost ones);
past ``MAX_BYTES`` the oldest ended attempts go first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

KEEP_S = 30.0
"""How long an ended attempt's events are kept, seconds."""
MAX_BYTES = 128 << 20
"""Bytes of events kept at most beyond those of running attempts."""
MAX_REPLAY_BYTES = 512 << 10
"""One answer carries at most this many bytes of events (NATS' default payload limit is 1 MiB);
the gateway asks again for the rest."""


@dataclass
class _Attempt:
    events: list[bytes] = field(default_factory=list)
    size: int = 0
    ended_s: float | None = None
    """When the attempt ended here (``time.monotonic()``), None while it runs."""


class SentEvents:
    """Running attempts by key; ended ones in the order they ended, so that forgetting the old
    ones looks only at those it forgets (an attempt's end costs no walk over all kept)."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, int], _Attempt] = {}
        self._ended: OrderedDict[tuple[str, int], _Attempt] = OrderedDict()
        self._ended_bytes = 0

    def _kept(self, key: tuple[str, int]) -> _Attempt | None:
        return self._running.get(key) or self._ended.get(key)

    def add(self, request_id: str, attempt: int, seq: int, data: bytes) -> None:
        """Keep event ``seq`` of the attempt (events are added in ``seq`` order from 0)."""
        key = (request_id, attempt)
        kept = self._kept(key)
        if kept is None:
            kept = self._running[key] = _Attempt()
        if seq == len(kept.events):
            kept.events.append(data)
            kept.size += len(data)
            if kept.ended_s is not None:
                self._ended_bytes += len(data)

    def get(self, request_id: str, attempt: int, from_seq: int, to_seq: int) -> list[bytes] | None:
        """Events ``from_seq`` to ``to_seq - 1`` (fewer when they exceed ``MAX_REPLAY_BYTES``,
        never none of those kept); None when the attempt is not kept."""
        kept = self._kept((request_id, attempt))
        if kept is None:
            return None
        out: list[bytes] = []
        size = 0
        for data in kept.events[from_seq:to_seq]:
            if out and size + len(data) > MAX_REPLAY_BYTES:
                break
            out.append(data)
            size += len(data)
        return out

    def end(self, request_id: str, attempt: int, now: float | None = None) -> None:
        """The attempt ended here: keep its events ``KEEP_S`` more; forget what is past its time
        or over ``MAX_BYTES`` (the oldest ended first)."""
        now = time.monotonic() if now is None else now
        kept = self._running.pop((request_id, attempt), None)
        if kept is not None:
            kept.ended_s = now
            self._ended[(request_id, attempt)] = kept
            self._ended_bytes += kept.size
        while self._ended:
            old = next(iter(self._ended.values()))
            if now - old.ended_s < KEEP_S and self._ended_bytes <= MAX_BYTES:
                break  # ended attempts are in the order they ended: the rest are younger
            self._ended.popitem(last=False)
            self._ended_bytes -= old.size
