"""The bench starts its front ends off the engine core (``front_end_cores``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.harness import front_end_cores


def _child_cores() -> set[int]:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(json.loads(out))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_processes_started_inside_avoid_the_engine_core_and_the_mask_comes_back() -> None:
    before = os.sched_getaffinity(0)
    engine = min(before)
    with front_end_cores(engine):
        assert _child_cores() == before - {engine}
    assert os.sched_getaffinity(0) == before
    assert _child_cores() == before


def test_no_engine_core_or_no_other_core_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with front_end_cores(None):
        assert os.sched_getaffinity(0) == before
    only = min(before)
    os.sched_setaffinity(0, {only})
    try:
        with front_end_cores(only):
            assert os.sched_getaffinity(0) == {only}
    finally:
        os.sched_setaffinity(0, before)
    assert os.sched_getaffinity(0) == before
