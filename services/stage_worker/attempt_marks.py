"""Attempt numbers a worker remembers per request for a while: the latest attempt of a request
that ended here (late input of it is dropped), and the attempt of the upstream stage a request
moved to (input from older upstream attempts is stale)."""

from __future__ import annotations

import time

MARK_TTL_S = 600.0
"""How long a mark is kept at least, seconds: longer than any request's deadline."""
MAX_MARKS = 10_000
"""Marks held before those older than ``MARK_TTL_S`` are forgotten."""


class AttemptMarks:
    """Request id → an attempt number that only grows (0 for a request without a mark). Times are
    on the monotonic clock."""

    def __init__(self, ttl_s: float = MARK_TTL_S, max_marks: int = MAX_MARKS) -> None:
        self._ttl_s, self._max = ttl_s, max_marks
        self._marks: dict[str, tuple[float, int]] = {}

    def raise_to(self, request_id: str, attempt: int) -> None:
        """Mark ``request_id`` with ``attempt`` unless it has a higher mark already."""
        now = time.monotonic()
        self._marks[request_id] = (now, max(attempt, self.get(request_id)))
        if len(self._marks) > self._max:
            self._marks = {k: v for k, v in self._marks.items() if now - v[0] < self._ttl_s}

    def get(self, request_id: str) -> int:
        mark = self._marks.get(request_id)
        return 0 if mark is None else mark[1]
