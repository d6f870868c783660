"""The attempt numbers a worker remembers per request only grow, and old ones are forgotten once
there are too many."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.stage_worker import attempt_marks
from services.stage_worker.attempt_marks import AttemptMarks


def test_a_mark_only_grows_and_a_request_without_one_reads_0() -> None:
    marks = AttemptMarks()
    assert marks.get("r") == 0
    marks.raise_to("r", 2)
    marks.raise_to("r", 1)
    assert marks.get("r") == 2
    marks.raise_to("r", 3)
    assert marks.get("r") == 3


def test_marks_older_than_the_ttl_are_forgotten_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock the test sets (the module's ``time.monotonic``): ages are exact, whatever the
    machine does between two lines."""
    now = [1000.0]
    monkeypatch.setattr(attempt_marks, "time", SimpleNamespace(monotonic=lambda: now[0]))
    marks = AttemptMarks(ttl_s=10.0, max_marks=2)
    marks.raise_to("old", 1)
    now[0] += 10.0
    marks.raise_to("a", 1)
    assert marks.get("old") == 1  # as old as the TTL, but within the limit: kept
    now[0] += 9.9
    marks.raise_to("b", 1)  # past the limit: "old" (19.9 s) goes, "a" (9.9 s) stays
    assert (marks.get("old"), marks.get("a"), marks.get("b")) == (0, 1, 1)
