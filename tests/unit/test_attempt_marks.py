"""The attempt numbers a worker remembers per request only grow, and old ones are forgotten once
there are too many."""

from __future__ import annotations

import time

from services.stage_worker.attempt_marks import AttemptMarks


def test_a_mark_only_grows_and_a_request_without_one_reads_0() -> None:
    marks = AttemptMarks()
    assert marks.get("r") == 0
    marks.raise_to("r", 2)
    marks.raise_to("r", 1)
    assert marks.get("r") == 2
    marks.raise_to("r", 3)
    assert marks.get("r") == 3


def test_marks_older_than_the_ttl_are_forgotten_past_the_limit() -> None:
    marks = AttemptMarks(ttl_s=0.05, max_marks=2)
    marks.raise_to("old", 1)
    time.sleep(0.1)
    marks.raise_to("a", 1)
    assert marks.get("old") == 1  # within the limit: kept
    marks.raise_to("b", 1)
    assert (marks.get("old"), marks.get("a"), marks.get("b")) == (0, 1, 1)
