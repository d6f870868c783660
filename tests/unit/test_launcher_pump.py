"""``omnirelay up`` copies each service's output line by line: a line longer than the reader's
limit (64 KiB) must not stop the copying, or the service blocks on its full pipe at its next log
line (found by the bus fuzzer, tests/e2e/test_fuzz_bus.py: a log line quoting a 64 KiB field froze
the gateway and a thinker)."""

from __future__ import annotations

import asyncio

import pytest

from cli.launcher import _pump


async def test_a_line_over_the_limit_is_cut_and_the_copying_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reader = asyncio.StreamReader()  # the default limit, as asyncio.create_subprocess_exec's pipes
    reader.feed_data(b"before\n" + b"x" * (200 * 1024) + b"\nafter\n")
    reader.feed_eof()
    await asyncio.wait_for(_pump("svc", reader, 5), 10)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "svc   | before" and lines[-1] == "svc   | after", lines[:2] + lines[-2:]
    assert any("over 64 KiB was cut" in ln for ln in lines)
