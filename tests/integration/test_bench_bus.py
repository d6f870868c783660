"""``omnirelay bench bus`` on a real nats-server: every message of both hop kinds arrives and is timed."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.bus_hop import HEADER, MODES, run_bus_bench


def test_every_hop_kind_is_measured_on_both_placements() -> None:
    began_ns = time.time_ns()
    stats = run_bus_bench(messages=30, interval_s=0.002, warmup=5)
    run_ms = (time.time_ns() - began_ns) / 1e6
    assert [(s.mode, s.pinned) for s in stats] == [(m, p) for p in (False, True) for m in MODES]
    for s in stats:
        assert len(s.samples_ms) == 30
        # Positive (the same wall clock on both sides), and no message took longer than the whole
        # run as this test timed it.
        assert all(0 < x < run_ms for x in s.samples_ms), (s.mode, run_ms, s.samples_ms)


def test_cli_prints_the_table() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "bench",
            "bus",
            "--messages",
            "10",
            "--warmup",
            "2",
            "--interval-ms",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    assert lines[0] == HEADER
    assert [line.split()[:3] for line in lines[2:]] == [
        ["jetstream", "any", "core"],
        ["core", "any", "core"],
        ["jetstream", "one", "core"],
        ["core", "one", "core"],
    ]
